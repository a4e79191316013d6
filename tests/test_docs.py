"""The README and docs/ stay true to the tree: the configuration page is the settings rendered, every relative
link resolves, the README stays a product page, and no label from how the work was organised is left."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
WORK_LABEL = re.compile(r"\bstops?[ -]\d+\b", re.IGNORECASE)


def test_configuration_page_is_the_settings_rendered():
    from tandem_tools.configdoc import REGENERATE, render

    page = ROOT / "docs" / "configuration.md"
    assert page.is_file(), f"docs/configuration.md is missing: generate it with `{REGENERATE}`"
    assert page.read_text() == render(), (
        f"docs/configuration.md is stale (the settings or their flags changed): regenerate it with `{REGENERATE}`"
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_readme_is_a_product_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: measurements go to docs/benchmarks.md"


def test_readme_tests_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1].strip()
    command = ci.split("cd ", 1)[-1] if ci.startswith("cd ") else ci
    assert command in (ROOT / "README.md").read_text(), f"README.md must show the tests command .ci/run runs: {command}"


def tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
        return [ROOT / name for name in out.stdout.splitlines() if (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the files on disk
        skip = {".venv", ".git", "node_modules"}
        return [p for pattern in patterns for p in ROOT.rglob(pattern) if not skip & set(p.parts)]


def test_no_labels_from_how_the_work_was_organised():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in tracked("*.py", "*.md", "*.sh")
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if WORK_LABEL.search(line)
    ]
    assert not found, "say what and why, not which working session:\n" + "\n".join(found)
