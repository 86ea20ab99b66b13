"""What the tests share: paths, process helpers, parsers, fakes and stand-in peers. Test modules import from here,
never from each other; ``tests/conftest.py`` only registers fixtures."""
