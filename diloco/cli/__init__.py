"""The command line: ``app`` (the ``diloco`` command and ``python -m diloco.train``: argv and a config file to a
validated config, then one call), ``monitor`` (``diloco status``'s table) and ``spellings`` (other trainers' flags)."""
