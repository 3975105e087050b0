"""The docs pages' snippets run and print what the pages say they print (tests/doc_snippets.py;
`python tests/doc_snippets.py --update PAGE` pastes in the real output after a change)."""

import pytest

import doc_snippets

# Pages whose ```python blocks are whole programs (the others show fragments of a training loop,
# run for real by the examples they link to).
PAGES = ["docs/opt_levels.md", "docs/op_policy.md", "docs/backend.md", "docs/explain.md",
         "docs/float8.md", "docs/optimizer_memory.md", "docs/migrating_from_apex.md",
         "docs/integrations.md", "docs/planner.md"]


@pytest.mark.parametrize("page", PAGES)
def test_snippets_print_what_the_page_shows(page):
    _, pairs = doc_snippets.run_page(page)
    assert pairs, f"{page} has no python block followed by its output"
    for block, out in pairs:
        assert out == block.body, f"{page}, the output at line {block.line} differs"
