"""docs/conformance.md and the README's feature table say what the corpus says."""

from . import docs_table


def test_conformance_page_is_current():
    assert docs_table.PAGE.read_text() == docs_table.page(), (
        "docs/conformance.md is out of date: python -m tests.conformance.docs_table --update")


def test_readme_feature_table_is_current():
    current = docs_table.README.read_text()
    assert docs_table.readme(current) == current, (
        "README.md's feature table is out of date: python -m tests.conformance.docs_table "
        "--update")
