"""Which Ray cluster a job runs on, and getting onto it (``grpo-cluster run`` / ``validate``, bench/step_budget).

The address is, first found: ``--address``, the spec's ``ray.address``, ``$RAY_ADDRESS``. With none, the job
starts its own single-node cluster — always its own (``ray.init(address="local")``), even when another cluster
(e.g. a ``ray start --head`` left running) is on this machine — bound to 127.0.0.1 (node IP, GCS, raylet, object
manager), without a dashboard. With one, the job joins that cluster and says so in one line on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

__all__ = ["LOCAL_NODE_IP", "AddressError", "init_ray", "job_address", "local_cluster_resources", "reachable",
           "use_token_if_available"]

LOCAL_NODE_IP = "127.0.0.1"
"""Node IP of a locally started cluster: every Ray port of that cluster listens on loopback only."""


class AddressError(ValueError):
    """The cluster address cannot be used (a Jobs API URL where a GCS address is needed, or nothing answers)."""


def job_address(cli_address: str | None, spec) -> tuple[str | None, str]:
    """The Ray cluster address a job uses and where it came from.

    Args:
        cli_address: ``--address`` (None when not given).
        spec: the validated ``cluster.spec.JobSpec`` (its ``ray.address``).
    Returns:
        (address or None for a local cluster, source: ``"--address"``, ``"ray.address"``, ``"$RAY_ADDRESS"`` or
        ``"local"``).
    Raises:
        AddressError: an ``http(s)://`` (dashboard / Jobs API) address, or a ``HOST:PORT`` where no TCP connection
            opens within 5 s.
    """
    env = os.environ.get("RAY_ADDRESS") or None
    address, source = next(((a, s) for a, s in ((cli_address, "--address"), (spec.ray.address, "ray.address"),
                                                  (env, "$RAY_ADDRESS")) if a), (None, "local"))
    if address is None:
        return None, source
    if address.startswith(("http://", "https://")):
        raise AddressError(
            f"{address} ({source}) is a Ray Jobs API (dashboard) address; `run` needs the cluster's GCS address "
            f"(HOST:6379 or auto) — or send the job there with `grpo-cluster submit SPEC --address {address}`. "
            f"(Unset $RAY_ADDRESS for a local run.)")
    if not reachable(address):
        raise AddressError(f"cannot reach a Ray cluster at {address} ({source})")
    return address, source


def reachable(address: str, timeout_s: float = 5.0) -> bool:
    """For a ``host:port`` GCS address, whether a TCP connection opens within ``timeout_s`` (Ray itself retries for
    minutes). Other forms (``auto``, ``ray://``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return True
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def init_ray(spec, address: str | None, source: str = "--address", log_to_driver: bool = True,
             verbose: bool = True) -> None:
    """``ray.init`` for a job: join ``address`` (one line on stderr says so), or start a local cluster of
    ``spec.ray.num_cpus`` CPUs on 127.0.0.1 when ``address`` is None.

    Args:
        spec: the validated JobSpec (``ray.num_cpus``, ``ray.dashboard_host``).
        address: from :func:`job_address`.
        source: where ``address`` came from, for the message.
        verbose: False (``run`` without ``--verbose``): the job's workers on a cluster started here log library
            records below ERROR to ``output_dir/logs/<worker>.log`` (``contract.console``: the variables are set in
            this process while the cluster starts, so its workers inherit them, and restored after, so a worker
            built later in this process does not reroute it); a joined cluster's workers log
            as that cluster was set up. Ray's own notes in this process go to ``driver.log`` too
            (``contract.console.quiet_library_terminals``; ``ray.init(configure_logging=False)``).
    Raises:
        AddressError: ``address`` was given and joining it failed (no GCS there, a token refused).
    """
    import ray  # noqa: F401  (imported first: it attaches its terminal handler, which the next call silences)

    from contract.console import LOG_DIR_ENV, VERBOSE_ENV, quiet_library_terminals

    quiet_library_terminals()  # Ray attaches its own terminal handler when imported; routed, it goes to the file
    quiet = {} if verbose else {"configure_logging": False}  # ray.init would attach it again
    saved = {name: os.environ.get(name) for name in (LOG_DIR_ENV, VERBOSE_ENV)}
    os.environ[LOG_DIR_ENV] = os.path.join(os.path.abspath(spec.output_dir), "logs")
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    try:
        _init(spec, address, source, log_to_driver, quiet)
    finally:  # the cluster's processes have them; a worker built later in this process must not take them
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def use_token_if_available() -> None:
    """Send the cluster's token when one is configured here: Ray's own rule
    (``maybe_enable_token_auth_if_token_available``, as ``ray start`` and ``ray.init(address="auto")`` apply it),
    without its log warning. Used by ``init_ray`` joining a cluster and by the Jobs API client
    (``cluster.ops.jobs.connect``)."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray without token authentication
        return
    log = logging.getLogger(setup.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.setLevel(level)


def _init(spec, address: str | None, source: str, log_to_driver: bool, quiet: dict) -> None:
    import ray

    if address is not None:
        use_token_if_available()  # as `ray start` and ray.init(address="auto") do: send the cluster's token if any
        try:
            ray.init(address=address, log_to_driver=log_to_driver, logging_level=logging.WARNING, **quiet)
        except (ConnectionError, RuntimeError) as exc:
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise AddressError(f"cannot join the Ray cluster at {address} ({source}): {first}") from None
        print(f"[grpo-cluster] joined the existing Ray cluster at {address} ({source})", file=sys.stderr)
        return
    with _loopback_only():
        ray.init(address="local", num_cpus=spec.ray.num_cpus, include_dashboard=False,
                 dashboard_host=spec.ray.dashboard_host, log_to_driver=log_to_driver, **quiet)


def local_cluster_resources(spec) -> dict[str, float]:
    """What the local cluster :func:`init_ray` starts would have, computed the way Ray computes it when it starts,
    without starting it: ``CPU`` = ``ray.num_cpus`` or the CPUs Ray detects (container limits included), ``GPU`` =
    the GPUs Ray detects and this process may see (``CUDA_VISIBLE_DEVICES``), no custom resource. ``validate``
    checks a spec against it, so a job that asks for a GPU on a machine without one is refused there, as ``run``
    would be refused."""
    from ray._private import accelerators
    from ray._private.utils import get_num_cpus

    gpus = 0
    manager = accelerators.get_accelerator_manager_for_resource("GPU")
    if manager is not None:
        gpus = manager.get_current_node_num_accelerators()
        visible = manager.get_current_process_visible_accelerator_ids()
        if visible is not None:
            gpus = min(gpus, len(visible))
    cpus = spec.ray.num_cpus if spec.ray.num_cpus is not None else get_num_cpus()
    return {"CPU": float(cpus), "GPU": float(gpus)}


@contextlib.contextmanager
def _loopback_only():
    """While starting a local cluster, make Ray use 127.0.0.1 as the node IP and bind every port there.

    ``ray.init(_node_ip_address="127.0.0.1")`` and ``ray start --node-ip-address 127.0.0.1`` do not do it: Ray
    rewrites a loopback address to the machine's routable IP (``services.resolve_ip_for_localhost``). Ray keeps to
    loopback only when it treats clusters as disabled on this OS: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read into
    ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` at import. Both are set for the duration of ``ray.init`` (the
    raylet and workers it starts inherit the variable) and restored afterwards, so that a later ``ray.init`` that
    joins a remote cluster from this process still finds its routable IP.
    """
    from ray._private import ray_constants

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    old_env, old_flag = os.environ.get(name), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[name], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old_env
