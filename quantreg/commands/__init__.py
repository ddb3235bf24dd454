"""Each ``quantreg`` subcommand's function, grouped by what it answers from.

:mod:`quantreg.cli` holds the parser and the boundary every command runs inside (exit codes, the
``--json`` envelope of a usage error, no traceback); the commands themselves live here:
:mod:`.tables` answers from the rule tables (list, plugins, rules, explain, validate),
:mod:`.tools` hands off to the module that does the work (doctor, plan, tiny-model, tune, schema,
demo, new-plugin, check-method). A new command is a function in one of these and one ``add(...)``
line in :func:`quantreg.cli.build_parser` (docs/design.md, "Recipes").
"""
