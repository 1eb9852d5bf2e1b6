"""Keep BENCHMARKS.md a short reference: at most 25 KB; every tools/ script named in
BENCHMARKS.md or docs/; every command in BENCHMARKS.md names files that exist; every section
gives a card, a date and a command; a summary row is one short cell with a date and a link; no
issue numbers. (Its links are test_readme.py's.)"""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


BENCHMARKS = read("BENCHMARKS.md")
DOCS = {path: read(path) for path in sorted(glob.glob("docs/*.md", root_dir=ROOT))}
CARD = r"H100|H200|CPU"
DATE = r"20\d\d-\d\d-\d\d"
# A command: inline code or an indented / fenced block line that runs something.
COMMAND = r"(?:python3?|bash|make|torchrun)\b"


def commands(text):
    """The command lines of a page: inline code spans and the lines of fenced blocks that start
    with a launcher (job lists inside a heredoc are flags, not commands)."""
    text_only = re.sub(r"(?ms)^```.*?^```", "", text)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text_only)]
    found = [span for span in spans if re.match(r"(?:\w+=\S+ )*" + COMMAND, span)]
    for block in re.findall(r"(?ms)^```\w*\n(.*?)^```", text):
        found += [line for line in block.splitlines() if re.match(r"(?:\w+=\S+ )*" + COMMAND, line)]
    return found


def sections(text):
    """(heading, body) of each ## section after the summary, with its ### subsections in its body."""
    parts = re.split(r"(?m)^## (.+)$", text)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2) if parts[i] != "Summary"]


def test_benchmarks_is_at_most_25_kb():
    assert len(BENCHMARKS.encode()) <= 25_600


def test_every_tools_script_is_named_in_benchmarks_or_docs():
    pages = BENCHMARKS + "".join(DOCS.values())
    for path in sorted(glob.glob("tools/*.py", root_dir=ROOT) + glob.glob("tools/*.sh", root_dir=ROOT)):
        assert path in pages, f"{path} is named in neither BENCHMARKS.md nor docs/: delete it or cite its figure"


def test_every_command_names_files_that_exist():
    cmds = commands(BENCHMARKS)
    assert len(cmds) >= 10
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", read("Makefile"), re.M))
    for cmd in cmds:
        for name in re.findall(r"(?<![\w/.$-])((?:[\w-]+/)*[\w-]+\.(?:py|sh|toml))\b", cmd):
            assert os.path.isfile(os.path.join(ROOT, name)), f"BENCHMARKS.md runs {name}, which is not there: {cmd}"
        for target in re.findall(r"\bmake ([a-z][a-z0-9-]*)", cmd):
            assert target in targets, f"BENCHMARKS.md runs make {target}, no such target"


def test_every_section_gives_card_date_and_command():
    found = sections(BENCHMARKS)
    assert len(found) >= 6
    for heading, body in found:
        assert re.search(CARD, body), f"section {heading!r} names no card"
        assert re.search(DATE, body), f"section {heading!r} gives no date"
        assert commands(body), f"section {heading!r} gives no command"


def test_summary_rows_are_short_with_a_card_a_date_and_a_link():
    summary = BENCHMARKS.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and not r.startswith("| ---")][1:]
    assert len(rows) >= 8
    for row in rows:
        question, figure, card_date, link = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(figure) <= 110, f"summary cell too long: {figure}"
        assert re.search(CARD, card_date) and re.search(DATE, card_date), row
        assert re.fullmatch(r"\[[^]]+\]\(#[^)]+\)", link), row


def test_no_issue_numbers():
    for path, text in {"BENCHMARKS.md": BENCHMARKS, **DOCS}.items():
        assert not re.search(r"(?i)\bissues? \d+|\(#\d+\)", text), path
