"""Tests of several processes, or of a framework, a script or a documented command run end to end:
marked ``slow`` (or ``gpu``), beside the few quick checks of the same subject (unmarked, held to the
quick tier's rules). A package, so that its test modules import as ``integration.test_...``, never
clashing with those of unit/."""
