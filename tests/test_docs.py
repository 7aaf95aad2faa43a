"""The documentation runs: every ```python and ```bash block of README.md and docs/*.md is
executed, one test per block (its id is ``file:line``), so a renamed option fails here instead
of in a reader's hands.

The convention (docs/development.md):
- a ```python block runs as a standalone script (cwd a fresh temporary directory, the repository
  on PYTHONPATH); a ```bash block runs with bash (``-e -o pipefail``) from the repository root,
  with ``TMPDIR`` a fresh temporary directory and this interpreter's directory first on PATH;
- ``<!-- docs-test: continue -->`` before a python block appends it to the page's previous
  python block, and the two run together;
- ``<!-- docs-test: replace "OLD" "NEW" -->`` (several may precede one block) substitutes before
  running, to shrink steps and sizes; an OLD the block lacks is an error;
- ``<!-- docs-test: skip REASON -->`` skips the block (and blocks continuing it);
- ```text, ```console, ```yaml, ```json and ```toml blocks are not run; any other tag, or none,
  is an error, so nothing escapes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from tests.multiprocess import fresh_process_env, run_command, run_script
from tests.test_layering import ROOT

RUN = ("python", "bash")
NOT_RUN = ("text", "console", "yaml", "json", "toml")
#: Seconds one block may take (a few on CPU is the rule; the demo's shrunken runs take ~10).
TIMEOUT = 180
FENCE = re.compile(r"^(\s*)```(.*)$")
DIRECTIVE = re.compile(r"^<!-- docs-test: (continue|replace|skip)\b(.*?)\s*-->$")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


class DocsError(Exception):
    """A page that breaks the convention."""


@attrs.frozen(kw_only=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str  # as run: replacements applied, continued blocks prepended
    skip: str | None = None

    @property
    def name(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


def parse(page: Path) -> list[Block]:
    """The page's blocks, checked against the convention; raises :class:`DocsError`."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    pending: list[tuple[str, str, int]] = []  # directives waiting for their block
    previous_python: Block | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        where = f"{page.name}:{index + 1}"
        directive = DIRECTIVE.match(line.strip())
        if line.strip().startswith("<!-- docs-test"):
            if directive is None:
                raise DocsError(f"{where}: malformed directive {line.strip()!r}")
            pending.append((directive.group(1), directive.group(2).strip(), index + 1))
            index += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and pending:
                raise DocsError(f"{where}: a docs-test directive must directly precede a block")
            index += 1
            continue
        indent, language = fence.group(1), fence.group(2).strip()
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise DocsError(f"{where}: the block is never closed")
        body = [text.removeprefix(indent) for text in lines[index + 1 : end]]
        code = "\n".join(body) + "\n"
        if not language:
            raise DocsError(
                f"{where}: a block without a language; tag it ({', '.join(RUN + NOT_RUN)})"
            )
        if language not in RUN + NOT_RUN:
            raise DocsError(f"{where}: unknown block language {language!r}")
        block = _apply(page, index + 1, language, code, pending, previous_python, where)
        pending = []
        if language in RUN:
            blocks.append(block)
        if language == "python":
            previous_python = block
        index = end + 1
    if pending:
        raise DocsError(f"{page.name}: docs-test directives at the end of the page")
    return blocks


def _apply(
    page: Path,
    line: int,
    language: str,
    code: str,
    directives: list[tuple[str, str, int]],
    previous: Block | None,
    where: str,
) -> Block:
    skip: str | None = None
    for kind, argument, _ in directives:
        if language not in RUN:
            raise DocsError(f"{where}: docs-test {kind} before a {language} block (not run)")
        if kind == "replace":
            pair = QUOTED.findall(argument)
            if len(pair) != 2:
                raise DocsError(f'{where}: replace takes "OLD" "NEW", got {argument!r}')
            old, new = (text.replace('\\"', '"') for text in pair)
            if old not in code:
                raise DocsError(f"{where}: replace {old!r}: the block does not contain it")
            code = code.replace(old, new)
        elif kind == "skip":
            if not argument:
                raise DocsError(f"{where}: skip needs a reason")
            skip = argument
    if any(kind == "continue" for kind, _, _ in directives):
        if language != "python" or previous is None:
            raise DocsError(f"{where}: continue needs a previous python block on the page")
        code = previous.code + code
        if previous.skip is not None and skip is None:
            skip = f"continues a skipped block ({previous.skip})"
    return Block(page=page, line=line, language=language, code=code, skip=skip)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in parse(page)]


def run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess[str]:
    interpreter = Path(sys.executable).parent
    path = os.pathsep.join([str(interpreter), os.environ.get("PATH", "")])
    env = fresh_process_env(TMPDIR=str(workdir), PATH=path)
    if block.language == "python":
        script = workdir / "block.py"
        script.write_text(block.code)
        return run_script(script, env, workdir, TIMEOUT)
    return run_command(["bash", "-e", "-o", "pipefail", "-c", block.code], env, ROOT, TIMEOUT)


BLOCKS = all_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_documentation_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    result = run_block(block, tmp_path)
    assert result.returncode == 0, (
        f"{block.name} failed (status {result.returncode}):\n{block.code}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    )


# -- the quick start is what CI and the install run ---------------------------------------------
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -c constraints-cpu.txt -e '.[test]'"
DEMO = ".venv/bin/python -m engine demo"


def commands(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if line.strip() and not line.startswith("#")]


def test_the_quick_start_commands_are_the_install_and_what_ci_runs() -> None:
    readme = parse(ROOT / "README.md")
    quick_start = readme[0]
    assert quick_start.language == "bash"
    assert commands(quick_start.code) == [f"{INSTALL} && {DEMO}", "bash .ci/run"]
    # .ci/run makes the same environment (python3 unless PYTHON says) with the same install
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python="${PYTHON:-python3}"' in ci and '"$python" -m venv .venv' in ci
    assert "pip install --quiet -c constraints-cpu.txt -e '.[test]'" in ci


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", pages(), ids=[path.name for path in pages()])
def test_every_relative_link_points_at_a_file_of_the_repository(path: Path) -> None:
    targets = [target.split("#")[0] for target in LINK.findall(path.read_text())]
    local = [target for target in targets if target and "://" not in target]
    assert [target for target in local if not (path.parent / target).exists()] == []


def test_the_readme_links_every_documentation_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in pages()[1:] if f"(docs/{p.name})" not in readme] == []


# -- the convention itself ----------------------------------------------------------------------


def page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_continue_replace_and_skip_shape_what_runs(tmp_path: Path) -> None:
    text = (
        "```python\nx = 1\n```\n\n```text\nnot run\n```\n\n"
        '<!-- docs-test: continue -->\n<!-- docs-test: replace "2" "3" -->\n'
        '<!-- docs-test: replace "y" "z" -->\n```python\ny = x + 2\n```\n\n'
        "<!-- docs-test: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n"
    )
    first, second, third = parse(page(tmp_path, text))
    assert first.code == "x = 1\n" and first.skip is None
    assert second.code == "x = 1\nz = x + 3\n" and second.line == 12
    assert third.skip == "needs a GPU" and third.language == "bash"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("```\nprint(1)\n```\n", "a block without a language"),
        ("```sh\nls\n```\n", "unknown block language 'sh'"),
        ('<!-- docs-test: replace "absent" "x" -->\n```python\npass\n```\n', "does not contain"),
        ("<!-- docs-test: skip -->\n```python\npass\n```\n", "skip needs a reason"),
        ("<!-- docs-test: continue -->\n```python\npass\n```\n", "needs a previous python"),
        ("<!-- docs-test: skip x -->\nprose\n```python\npass\n```\n", "directly precede"),
        ("<!-- docs-test: rerun -->\n```python\npass\n```\n", "malformed directive"),
        ("```python\npass\n", "never closed"),
    ],
)
def test_a_page_breaking_the_convention_is_an_error(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(DocsError, match=re.escape(message)):
        parse(page(tmp_path, text))


def test_a_failing_block_fails_its_test(tmp_path: Path) -> None:
    (block,) = parse(page(tmp_path, "```bash\npython -m engine train --no-such-option\n```\n"))
    result = run_block(block, tmp_path)
    assert result.returncode == 2 and "--no-such-option" in result.stderr


def test_the_architecture_map_names_every_module_and_package() -> None:
    """docs/architecture.md's "Where each concern lives" names every package (``name/``) and
    every module file of engine/, strategies/ and heads/, so a new module cannot go unmapped."""
    root = Path(ROOT)
    text = (root / "docs" / "architecture.md").read_text()
    section = text[text.index("## Where each concern lives") :]
    unnamed = []
    for top in ("engine", "strategies", "heads"):
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name != "__init__.py" and path.name not in section:
                unnamed.append(str(path.relative_to(root)))
            if path.name == "__init__.py" and f"{path.parent.name}/" not in section:
                unnamed.append(str(path.parent.relative_to(root)) + "/")
    assert not unnamed, f"docs/architecture.md's module map does not name {unnamed}"


def test_the_architecture_abilities_table_is_abilities_and_the_backends() -> None:
    """docs/architecture.md's abilities table lists exactly ``ABILITIES`` (name and protocol),
    and its megatron / fsdp2 columns say what the built-in backends are."""
    from engine.registry import BACKENDS
    from strategies.backends.base import ABILITIES

    text = (Path(ROOT) / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| .* \| (yes|no) \| (yes|no) \|$", text, re.M)
    assert {name: protocol for name, protocol, _, _ in rows} == {
        name: protocol.__name__ for name, protocol in ABILITIES.items()
    }
    backends = {name: BACKENDS.create(name) for name in ("megatron", "fsdp2")}
    for name, _, megatron, fsdp2 in rows:
        for backend, says in (("megatron", megatron), ("fsdp2", fsdp2)):
            has = isinstance(backends[backend], ABILITIES[name])
            assert has == (says == "yes"), (name, backend)
