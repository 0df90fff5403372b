"""Operations around a job: the ``validate`` and Jobs API subcommands (submit, status, logs, stop, scale), the checks
made before a job starts, Ray start-up, the Jobs API client, the job control actor and the metrics sinks.

May import Ray, ``cluster.spec`` and ``cluster.data``, and, inside functions, ``cluster.loop`` (resource checks,
setup errors) and ``cluster.driver`` (``prepare`` builds a dry-run ``GRPOJob``); ``prepare`` imports only the
standard library at module level so a bare interpreter can report a missing dependency.
"""
