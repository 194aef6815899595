"""ft's benchmarks. Run one from the repository root as a module, so that ``ft`` (the source
tree, built in place), ``bench`` and ``tests`` import from this checkout:

    .venv/bin/python -m bench.quorum_bench --quick

Each module's docstring gives its flags; docs/benchmarks.md has the commands and the numbers.
"""
