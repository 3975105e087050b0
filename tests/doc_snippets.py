"""Run the Python snippets of a docs page and compare what they print with the page.

A page's ```python blocks run in order in one fresh interpreter, as one script in which every
code line keeps its line number in the page (the rest is blank), named like the page, so that a
traceback or a node's stack trace points into the page. A ```text block right after a python
block is that block's printed output. Paths inside the repository are printed relative to it,
so a page reads the same from any checkout.

    python tests/doc_snippets.py docs/op_policy.md            # report the blocks that differ
    python tests/doc_snippets.py --update docs/op_policy.md   # paste the real output in
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARK = "\n@@fxamp-docs-block-end@@\n"

@dataclasses.dataclass
class Block:
    start: int  # offsets of the whole fenced block in the page
    end: int
    lang: str
    body: str
    line: int  # line number of the block's first code line


def blocks(text: str) -> list[Block]:
    return [Block(m.start(), m.end(), m.group(1), m.group(2),
                  text.count("\n", 0, m.start()) + 2) for m in FENCE.finditer(text)]


def _script(text: str, code: list[Block]) -> str:
    lines = [""] * (text.count("\n") + 1)
    for b in code:
        for k, line in enumerate(b.body.splitlines()):
            lines[b.line - 1 + k] = line
        closing = b.line - 1 + b.body.count("\n")  # the line of the closing fence
        lines[closing] = f"print({MARK!r}, end='', flush=True)"
    return "\n".join(lines) + "\n"


def run_page(page: str) -> tuple[str, list[tuple[Block, str]]]:
    """The page's text and (expected-output block, actual output) for each python block that
    has a text block right after it."""
    text = open(os.path.join(ROOT, page)).read()
    bs = blocks(text)
    code = [b for b in bs if b.lang == "python"]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_LOGS", None)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, os.path.basename(page))
        with open(script, "w") as f:
            f.write(_script(text, code))
        result = subprocess.run([sys.executable, script], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=900)
        stdout = result.stdout.replace(script, page)
    if result.returncode != 0:
        raise RuntimeError(f"{page}: a snippet failed\n{stdout[-2000:]}\n"
                           f"{result.stderr[-4000:]}")
    outputs = [o.replace(ROOT + os.sep, "") for o in stdout.split(MARK)[:-1]]
    pairs = []
    for block, out in zip(code, outputs):
        i = bs.index(block)
        follows = i + 1 < len(bs) and bs[i + 1].lang == "text" and \
            not text[block.end:bs[i + 1].start].strip()
        if follows:
            pairs.append((bs[i + 1], out))
    return text, pairs


def update(page: str) -> int:
    """Paste the real outputs into the page; returns how many blocks changed."""
    text, pairs = run_page(page)
    changed = [(b, out) for b, out in pairs if b.body != out]
    for b, out in sorted(changed, key=lambda p: -p[0].start):
        text = text[:b.start] + f"```text\n{out}```\n" + text[b.end:]
    with open(os.path.join(ROOT, page), "w") as f:
        f.write(text)
    return len(changed)


if __name__ == "__main__":
    args = sys.argv[1:]
    write = "--update" in args
    for page in (a for a in args if a != "--update"):
        if write:
            print(f"{page}: {update(page)} blocks updated")
        else:
            _, pairs = run_page(page)
            bad = [b.line for b, out in pairs if b.body != out]
            print(f"{page}: {len(pairs)} outputs, differing at lines {bad}")
