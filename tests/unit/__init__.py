"""Tests of one process: the quick tier (unmarked: no process started, at most a second each) and
the single-process tests marked ``slow`` (over a second) or ``gpu``. A package, so that its test
modules import as ``unit.test_...``, never clashing with those of integration/."""
