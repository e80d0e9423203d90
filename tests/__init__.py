"""Test suite (a package, so spawned workers can import ``tests.dist_cases``)."""
