"""Directories the benchmarks write once into their work directory and reuse on later runs."""

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

COMPLETE = ".complete"


def written_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, a directory that ``write(folder)`` fills: written on the first call, reused after.
    ``write`` fills a fresh folder beside ``target``, which becomes ``target``, marked complete,
    only once it has returned: a write cut off (an error, a killed process) leaves nothing a later
    call takes for whole."""
    if (target / COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if target.exists():  # left by an attempt cut off before its mark
        shutil.rmtree(target)
    folder.rename(target)
    (target / COMPLETE).write_text("")
    return target
