"""The command line's side of a job: the subcommands (``cli_*``: validate, eval, spec, merge and the Jobs API's
submit, status, logs, stop, scale), the checks made before a job starts (``prepare``), the Jobs API client and its
upload (``jobs``, ``upload``, ``reward_files``), held-out evaluation from a spec (``spec_eval``) and the configuration
reference generator (``spec_docs``).

Nothing below the command line imports this package: the loop, the runtimes and the metric sinks (``cluster.sinks``)
are imported from here, never the other way (tests/unit/test_import_layering.py). ``prepare`` imports only the
standard library at module level so a bare interpreter can report a missing dependency.
"""
