"""Shared by every test folder.

pytest puts the folder of a conftest.py outside a package on sys.path, so the helper modules
here (zoo.py, doc_snippets.py, autocast_lists.py) import by name from tests/ and its subfolders.
"""
