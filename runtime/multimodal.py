"""Images in requests: prompts of vLLM's shape, their preprocessing with the checkpoint's
processor, and what a sequence carries for its images through the engine.

``{"prompt": text, "multi_modal_data": {"image": img}}`` (``img`` a ``PIL.Image.Image`` or a list
of them), or ``"prompt_token_ids"`` instead of ``"prompt"``: each image has one placeholder in the
prompt, the processor's image token (``<image>``), in order. Each placeholder becomes as many image
tokens as its image has feature tokens (the counts the processor expands them to), and the model
writes the image's features over those tokens' embeddings.
"""

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from runtime.sampling_params import is_integer

# Modes the image processors convert to RGB faithfully; 16-bit and float images are not among them.
IMAGE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


def split_prompt(prompt) -> tuple[str | None, list[int] | None, list]:
    """A request's prompt as (text, token ids, images): one of the first two is None."""
    if isinstance(prompt, str):
        return _unicode(prompt), None, []
    if isinstance(prompt, (list, tuple)):
        return None, _token_ids(prompt, "a prompt of token ids"), []
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")
    unknown = [key for key in prompt if key not in PROMPT_KEYS]
    if unknown:
        raise ValueError(f"unknown prompt key {unknown[0]!r}; the keys are {', '.join(PROMPT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict has either 'prompt' or 'prompt_token_ids'")
    if "prompt" in prompt:
        text, token_ids = prompt["prompt"], None
        if not isinstance(text, str):
            raise ValueError(f"'prompt' is a string, got {type(text).__name__}")
        _unicode(text)
    else:
        text, token_ids = None, prompt["prompt_token_ids"]
        if not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"'prompt_token_ids' is a list of token ids, got {type(token_ids).__name__}")
        token_ids = _token_ids(token_ids, "'prompt_token_ids'")
    data = prompt.get("multi_modal_data", {})
    if not isinstance(data, dict) or any(key != "image" for key in data):
        raise ValueError(f"multi_modal_data is a dict with the one key 'image', got {data!r:.80}")
    images = data.get("image", [])
    return text, token_ids, list(images) if isinstance(images, (list, tuple)) else [images]


def _token_ids(ids, what: str) -> list[int]:
    """A list or tuple of token ids as Python ints; an element that is none is named with its place."""
    for place, token in enumerate(ids):
        if not is_integer(token):
            raise ValueError(f"{what}: element {place} is a {type(token).__name__} ({token!r:.40}), not a token id")
    return [int(t) for t in ids]


def _unicode(text: str) -> str:
    # A lone surrogate is no Unicode text: tokenizers raise a TypeError on it, not a request's error.
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"the prompt {text!r:.60} is not valid Unicode: {exc}") from None
    return text


def image_digest(index: int, image) -> bytes:
    """A hash of all that makes the image's RGB pixels (mode, size, pixels, palette, transparent
    colour), after checking it is an image the processor takes."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"image {index} is a {type(image).__name__}, not a PIL.Image.Image")
    try:
        image.load()
    except Exception as exc:  # a damaged file fails in PIL's decoders with errors of many types
        raise ValueError(f"image {index} cannot be decoded: {exc}") from exc
    width, height = image.size
    if width == 0 or height == 0:
        raise ValueError(f"image {index} is empty ({width}x{height} pixels)")
    if image.mode not in IMAGE_MODES:
        raise ValueError(f"image {index} has mode {image.mode!r}; the modes taken are {', '.join(IMAGE_MODES)}")
    digest = hashlib.blake2b(f"{image.mode} {width}x{height} {image.info.get('transparency')!r} ".encode(),
                             digest_size=16)
    digest.update(bytes(image.getpalette() or ()))
    digest.update(image.tobytes())
    return digest.digest()


@dataclass
class ImageInputs:
    """A request's images as the model's ``encode_images`` takes them, and where their image tokens
    are in the prompt. The features of all its images, in order, are one row per image token."""

    pixel_values: torch.Tensor
    image_sizes: torch.Tensor | None  # LLaVA-NeXT's: each image's size before tiling
    digests: list[bytes]  # one per image (``image_digest``)
    token_positions: np.ndarray  # the prompt positions of the image tokens, in order
    image_ends: np.ndarray  # per image, the end of its rows in the features (its tokens in token_positions)

    @property
    def num_tokens(self) -> int:
        return len(self.token_positions)

    def feature_rows(self, start: int, end: int) -> tuple[int, int]:
        """The rows of the features that the image tokens at prompt positions [start, end) take."""
        first, last = np.searchsorted(self.token_positions, (start, end))
        return int(first), int(last)

    def digests_in(self, start: int, end: int) -> tuple[bytes, ...]:
        """The digests of the images with tokens at prompt positions [start, end)."""
        first, last = self.feature_rows(start, end)
        if first == last:
            return ()
        first_image, last_image = np.searchsorted(self.image_ends, (first, last - 1), side="right")
        return tuple(self.digests[first_image : last_image + 1])


class ImagePreprocessor:
    """Turns a prompt with image placeholders and its images into the prompt's token ids, each
    placeholder expanded, and the ``ImageInputs``: the checkpoint's processor (transformers'
    ``AutoProcessor``) prepares the images and says how many feature tokens each one takes."""

    def __init__(self, processor, image_token_id: int):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token = processor.image_token
        self.image_token_id = image_token_id

    def __call__(self, text: str | None, token_ids: list[int] | None, images: list) -> tuple[list[int], ImageInputs]:
        ids = token_ids if text is None else self.tokenizer(text).input_ids
        placeholders = np.flatnonzero(np.array(ids) == self.image_token_id)
        if len(placeholders) != len(images):
            raise ValueError(f"the prompt has {len(placeholders)} image placeholders ({self.image_token!r}) "
                             f"but multi_modal_data has {len(images)} images")
        digests = [image_digest(index, image) for index, image in enumerate(images)]
        processed, counts = self._process(images)
        # Each placeholder becomes its image's run of image tokens; the text between stays as it is.
        pieces = np.split(np.array(ids, dtype=np.int64), placeholders)
        expanded = [pieces[0]]
        for count, piece in zip(counts, pieces[1:]):
            expanded += [np.full(count, self.image_token_id), piece[1:]]
        ids = np.concatenate(expanded)
        inputs = ImageInputs(
            pixel_values=processed["pixel_values"], image_sizes=processed.get("image_sizes"), digests=digests,
            token_positions=np.flatnonzero(ids == self.image_token_id), image_ends=np.cumsum(counts),
        )
        return ids.tolist(), inputs

    def _process(self, images: list) -> tuple[dict, list[int]]:
        """The processor's outputs for the images, and the number of image tokens it gives each: it
        expands one placeholder per image, with a letter between them so that each run stands apart."""
        text = "x".join([self.image_token] * len(images))
        try:
            processed = self.processor(text=text, images=images, return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"the processor cannot take the images: {exc}") from exc
        is_image = processed["input_ids"][0].numpy() == self.image_token_id
        starts = np.flatnonzero(is_image & ~np.concatenate(([False], is_image[:-1])))
        ends = np.flatnonzero(is_image & ~np.concatenate((is_image[1:], [False]))) + 1
        return processed, (ends - starts).tolist()
