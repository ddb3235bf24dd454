"""``quantreg tune``: measure every method that can run here on a checkpoint's real layer shapes, and
write a user table whose chain orders the correct ones by speed.

:mod:`.rank` (no torch) orders results; :mod:`.table` (no torch) writes the rule with its
``tuned:`` evidence atomically; :mod:`.measure` (torch, vLLM, the kit's harness) builds and times
the methods; :mod:`.command` is the CLI. See docs/tune.md.
"""
