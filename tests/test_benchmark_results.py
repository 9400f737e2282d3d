"""The logs under benchmarks/results/ and the documents that cite them agree: every log a README,
doc or card cites is there, every log there is cited, and every log has a line in its folder's MANIFEST
(the command and the commit that produced it)."""

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
             *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "model_cards").glob("*.md"))]
FOLDER = re.compile(r"(?:cpu|h100|h200)-\d{4}-\d{2}-\d{2}")
# A cited log: a path or a bare name, with * or {a,b} for several; "_2.log" right after a name
# stands for that name with its last "_" part replaced.
CITATION = re.compile(r"[\w./{},*-]*\.log\b")


def logs() -> dict[str, set[str]]:
    """Folder name -> the names of the files in it but its MANIFEST."""
    return {folder.name: {f.name for f in folder.iterdir() if f.name != "MANIFEST"}
            for folder in sorted(RESULTS.iterdir()) if folder.is_dir()}


def citations(text: str) -> list[tuple[str | None, str]]:
    """(folder or None, name pattern) of each log the text cites, braces expanded, shorthand resolved."""
    found, previous = [], None
    for token in CITATION.findall(text):
        folder = FOLDER.search(token)
        name = token.rsplit("/", 1)[-1]
        if name.startswith("_") and previous:
            name = previous.rsplit("_", 1)[0] + name
        previous = name
        braces = re.search(r"\{([^}]*)\}", name)
        names = [name[:braces.start()] + part + name[braces.end():] for part in braces.group(1).split(",")] \
            if braces else [name]
        found += [(folder.group(0) if folder else None, n) for n in names]
    return found


def cited_files(files: dict[str, set[str]]) -> tuple[set[tuple[str, str]], list[str]]:
    """The (folder, file) pairs the documents cite, and the citations that match no file. A bare name
    may lie in any folder (documents give the folder once for a row of logs)."""
    cited, missing = set(), []
    for document in DOCUMENTS:
        for folder, pattern in citations(document.read_text()):
            hits = {(f, name) for f in ([folder] if folder else files) for name in files.get(f, ())
                    if fnmatchcase(name, pattern)}
            if not hits:
                missing.append(f"{document.relative_to(ROOT)}: {folder + '/' if folder else ''}{pattern}")
            cited |= hits
    return cited, missing


def test_the_citation_reader_reads_paths_names_braces_globs_and_shorthand():
    text = ("`h200-2026-12-02/decode.log`, `../h200-2026-12-01/a_1.log`, `_2.log`, `results/cpu-2026-11-29/b.log`, "
            "`t_{1,bf16}.log`, `h200-2026-11-29/x_*.log`, `config.json`")
    assert citations(text) == [
        ("h200-2026-12-02", "decode.log"), ("h200-2026-12-01", "a_1.log"), (None, "a_2.log"),
        ("cpu-2026-11-29", "b.log"), (None, "t_1.log"), (None, "t_bf16.log"), ("h200-2026-11-29", "x_*.log"),
    ]


@pytest.fixture(scope="module")
def files():
    return logs()


def test_every_cited_log_is_there(files):
    _, missing = cited_files(files)
    assert missing == []


def test_every_log_is_cited(files):
    cited, _ = cited_files(files)
    uncited = sorted(f"{folder}/{name}" for folder, names in files.items() for name in names
                     if (folder, name) not in cited)
    assert uncited == []


def test_every_log_has_a_manifest_line(files):
    unlisted = []
    for folder, names in files.items():
        manifest = (RESULTS / folder / "MANIFEST").read_text()
        listed = {line.split("|")[0].strip() for line in manifest.splitlines() if "|" in line}
        unlisted += [f"{folder}/{name}" for name in sorted(names) if name not in listed]
    assert unlisted == []
