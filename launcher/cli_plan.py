"""`hetlaunch plan`: the plan `up` would run, from a live profile of a YAML's cluster or a saved
profile, printed as a table or JSON; nothing is trained. Registered on the one `hetlaunch` app by
launcher/cli.py; like it, it imports what it needs when it runs.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from hetlaunch.launcher.cli_cluster import join_token, load_cluster_file, new_token, with_cluster
from hetlaunch.launcher.cli_common import EXIT_BAD_INPUT, EXIT_JOB_FAILED, fail, plain_console
from hetlaunch.runtime.registry import AUTO_SCHEDULE, DEVICE_SCHEDULE_NAMES, MAX_MICROBATCHES, SCHEDULE_NAMES

Schedule = Enum("Schedule", {name: name for name in (*SCHEDULE_NAMES, *DEVICE_SCHEDULE_NAMES, AUTO_SCHEDULE)}, type=str)


def plan(
    cluster_yaml: Optional[Path] = typer.Argument(None, help="cluster YAML file (starts agents and profiles them)"),
    profile_file: Optional[Path] = typer.Option(None, "--profile", help="plan offline from a saved profile instead"),
    microbatches: Optional[int] = typer.Option(None, min=1, help="micro-batches per step (default: the YAML's, else 4; "
                                                                "with --global-batch: chosen)"),
    global_batch: Optional[int] = typer.Option(None, min=1, max=1 << 24,
                                               help="samples per step: the planner chooses micro-batch size and "
                                                    "count (default: the YAML's global_batch)"),
    schedule: Optional[Schedule] = typer.Option(None, help="pipeline schedule (default: the YAML's, else "
                                                           f"{AUTO_SCHEDULE}: the planner chooses)"),
    max_pipelines: Optional[int] = typer.Option(None, min=1, help="allow at most this many data-parallel pipelines "
                                                                  "(default: the YAML's, else as many as pay off)"),
    stages: Optional[int] = typer.Option(None, min=1, help="use exactly this many stages per pipeline"),
    compression: Optional[str] = typer.Option(None, help="codec on every boundary and sync: auto, none, fp16, bf16, "
                                                         "int8, int4, int4_rotated (default: the YAML's, else auto)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    token_file: Optional[Path] = typer.Option(None, help="join token for remote agents"),
    reprofile: bool = typer.Option(False, help="measure every node again instead of using cached profiles"),
    islands: bool = typer.Option(False, "--islands", help="plan islands with outer steps, one per region (the "
                                                        "YAML's train.outer when it has one)"),
    outer_every: Optional[int] = typer.Option(None, "--outer-every", min=1, max=10**9,
                                              help="with --islands: inner steps between outer steps (default: "
                                                   "the YAML's, else chosen)"),
) -> None:
    """Print the plan the planner would run (a table, or --json); train nothing."""
    from hetlaunch.launcher.planning.compression import CompressionConfig
    from hetlaunch.launcher.planning.planner import PlanningError
    from hetlaunch.launcher.planning.profile_file import ProfileError, load_profile
    from hetlaunch.launcher.planning.request import PlanRequest, plan_for
    from hetlaunch.launcher.progress import print_planner_result

    if cluster_yaml is None and profile_file is None:
        fail("give a cluster YAML (profiles it live), --profile PROFILE.json (offline), or both", EXIT_BAD_INPUT)
    if microbatches is not None and microbatches > MAX_MICROBATCHES:
        fail(f"--microbatches {microbatches}: at most {MAX_MICROBATCHES:,} per step", EXIT_BAD_INPUT)
    cluster = load_cluster_file(cluster_yaml) if cluster_yaml else None
    if cluster is not None and cluster.pinned:
        _refuse_over_pins({"--microbatches": microbatches, "--global-batch": global_batch, "--schedule": schedule,
                           "--max-pipelines": max_pipelines, "--stages": stages, "--compression": compression,
                           "--islands": islands or None, "--outer-every": outer_every})
    train = cluster.train if cluster else None
    batch_flags = [flag for flag, value in (("--global-batch", global_batch), ("--microbatches", microbatches))
                   if value is not None]
    global_batch = global_batch or (train.global_batch if train else None)
    fixed = microbatches or (train.fixed_microbatches if train and global_batch == train.global_batch else None)
    num_mb = microbatches or (train.batch_shape()[1] if train else 4)
    sched = schedule.value if schedule else (cluster.train.schedule if cluster else AUTO_SCHEDULE)
    if islands or outer_every is not None or (train is not None and train.outer is not None):
        _refuse_with_islands(sched, batch_flags if train is not None else [])
    if profile_file is not None:
        try:
            measured = load_profile(profile_file)
            if cluster is not None:  # planning this YAML's job from a saved profile: it must be of this model
                spec = cluster.model.to_spec()
                measured.check_model(spec.describe(), spec.known_num_layers or measured.model.num_layers,
                                     cluster.train.profile_size)
                measured = _of_the_yamls_nodes(cluster, measured, profile_file)
        except ProfileError as err:
            fail(str(err), EXIT_BAD_INPUT)
    else:
        measured = _measure_live(cluster, token_file, reprofile)
    if cluster is not None:  # what `up` prices: the cipher where data_plane.encrypt seals
        from hetlaunch.launcher.planning.profile_file import with_encryption

        measured = with_encryption(measured, cluster.data_plane.encrypt)
    if max_pipelines is None and cluster is not None and cluster.train.max_pipelines != "auto":
        max_pipelines = cluster.train.max_pipelines
    policy = cluster.compression if cluster else CompressionConfig()  # offline: auto
    if compression is not None:
        from hetlaunch.runtime.registry import CODEC_NAMES

        if compression not in ("auto", *CODEC_NAMES):
            fail(f"--compression must be auto or one of {', '.join(CODEC_NAMES)} (got {compression!r})", EXIT_BAD_INPUT)
        policy = CompressionConfig(intra_region=compression, cross_region=compression, sync=compression)
    # what `up` allows auto: device schedules where the YAML's nodes, islands and rebalance let them run
    # (offline without a YAML, where the request does: launcher/planning/request.py)
    from hetlaunch.launcher.device_schedule_checks import auto_refusal

    if cluster is not None and cluster.pinned:
        _plan_pinned(cluster, measured, as_json)
        return
    request = PlanRequest(num_microbatches=num_mb, schedule=sched, compression=policy, max_pipelines=max_pipelines,
                          global_batch=global_batch, fixed_microbatches=fixed, stages=stages,
                          device_schedules_refused=auto_refusal(cluster) if cluster is not None else None)
    if islands or outer_every is not None or (train is not None and train.outer is not None):
        _plan_islands(measured, request, train, outer_every, as_json)
        return
    try:
        result = plan_for(measured, request)  # the function `up` plans with
    except ProfileError as err:  # what the profile lacks (a link between two of its nodes): bad input
        fail(f"{profile_file}: {err}" if profile_file is not None else str(err), EXIT_BAD_INPUT)
    except PlanningError as err:
        fail(str(err), EXIT_JOB_FAILED)
    print_planner_result(plain_console(), measured, result, as_json=as_json)


def _of_the_yamls_nodes(cluster, measured, profile_file: Path):
    """The saved profile of the YAML's nodes only, as `up` measures them: a profile of other nodes
    planned stages on nodes the YAML does not have (a hostile review). ProfileError where the
    profile lacks one of them or puts it in another region: it is another cluster's."""
    from hetlaunch.launcher.planning.profile_edits import subset
    from hetlaunch.launcher.planning.profile_file import ProfileError

    regions = {n.name: n.region for n in measured.nodes}
    missing = [n.name for n in cluster.nodes if n.name not in regions]
    if missing:
        raise ProfileError(f"{profile_file}: no node {', '.join(missing)} of the YAML; profile this cluster "
                           "(hetlaunch profile) or plan without --profile")
    moved = [f"{n.name} (YAML {n.region}, profile {regions[n.name]})" for n in cluster.nodes
             if n.region != regions[n.name]]
    if moved:
        raise ProfileError(f"{profile_file}: another cluster's profile: its regions differ for {', '.join(moved)}")
    return subset(measured, [n.name for n in cluster.nodes])


def _refuse_with_islands(schedule: str, yaml_batch_flags: list[str]) -> None:
    """Before anything is measured: what an islands plan cannot honour (it printed a plan as if it had)."""
    from hetlaunch.runtime.registry import DEVICE_SCHEDULE_NAMES

    if schedule in DEVICE_SCHEDULE_NAMES:  # as validate and up refuse train.outer with it
        fail(f"--schedule {schedule}: islands are not supported with it (several stages per node sync every "
             "pipeline every step)", EXIT_BAD_INPUT)
    if yaml_batch_flags:  # the islands' plan takes the YAML's batch, as `up` runs it
        fail(f"{', '.join(yaml_batch_flags)}: with islands the YAML's batch is planned, as `up` runs it; change "
             "train.global_batch or train.num_microbatches there", EXIT_BAD_INPUT)


def _refuse_over_pins(overrides: dict) -> None:
    """Before anything is measured: options that would plan another cut than the YAML pins."""
    given = [flag for flag, value in overrides.items() if value is not None]
    if given:
        fail(f"{', '.join(given)}: the YAML pins every node's layers, and `up` runs that cut as the YAML gives it; "
             "change the YAML (or drop its `layers:`) to plan something else", EXIT_BAD_INPUT)


def _plan_pinned(cluster, measured, as_json: bool) -> None:
    """`hetlaunch plan` where the YAML pins `layers:`: the pinned cut priced as `up` prices it
    (launcher/job_driver.py make_plan), not a plan of the planner's own that `up` would never run."""
    from hetlaunch.launcher.adapt.replanner import Replanner
    from hetlaunch.launcher.planning.plan import pinned_num_layers, static_plan

    missing = [n.name for n in cluster.nodes if all(p.name != n.name for p in measured.nodes)]
    if missing:
        fail(f"the profile has no node {', '.join(missing)}, which the YAML pins layers on; profile this cluster "
             "(hetlaunch profile) or plan without --profile", EXIT_BAD_INPUT)
    _print_plan_of(lambda: Replanner(cluster, measured, lambda: [n.name for n in cluster.nodes]).priced_pins(
        static_plan(cluster, pinned_num_layers(cluster))), as_json, "the YAML's pinned cut, priced")


def _print_plan_of(make, as_json: bool, done: str) -> None:
    """Print the Plan `make()` returns, as `up` prints it (or as JSON, with planning_s), and how
    long it took; the planner's errors in one line."""
    import json
    import time

    from hetlaunch.launcher.planning.plan import TilingError
    from hetlaunch.launcher.planning.planner import PlanningError
    from hetlaunch.launcher.planning.profile_file import ProfileError
    from hetlaunch.launcher.progress import print_plan

    started = time.perf_counter()
    try:
        plan = make()
    except (TilingError, ProfileError) as err:  # pinned ranges of a model only agents can count; the profile's gaps
        fail(str(err), EXIT_BAD_INPUT)
    except PlanningError as err:
        fail(str(err), EXIT_JOB_FAILED)
    planning_s = time.perf_counter() - started
    if as_json:
        plain_console().print_json(json.dumps({**plan.to_dict(), "planning_s": planning_s}))
        return
    console = plain_console()
    print_plan(console, plan)
    console.print(f"{done} in {planning_s:.2f}s")


def _plan_islands(measured, request, train, every: int | None, as_json: bool) -> None:
    """`hetlaunch plan` with islands: the plan `up` would run (a table, or the plan as JSON)."""
    from hetlaunch.launcher.planning.island_plans import ProfileCluster, plan_islands
    from hetlaunch.launcher.train_config import OuterConfig, TrainConfig

    outer = train.outer if train is not None and train.outer is not None else OuterConfig()
    if every is not None:
        outer = outer.model_copy(update={"every": every, "delay": min(outer.delay, every - 1)})
    if train is None:  # offline without a YAML: the request's batch at the profile's micro-batch size
        from pydantic import ValidationError

        from hetlaunch.launcher.config_errors import describe

        batch = ({"global_batch": request.global_batch} if request.global_batch is not None
                 else {"num_microbatches": request.num_microbatches})
        try:
            train = TrainConfig(micro_batch_size=measured.micro_batch_size, **batch)
        except ValidationError as err:  # 65,537 samples at the profile's micro-batch size: too many micro-batches
            fail(f"--global-batch {request.global_batch}: {describe(err.errors()[0], TrainConfig)}", EXIT_BAD_INPUT)
    train = train.model_copy(update={"outer": outer})
    _print_plan_of(lambda: plan_islands(ProfileCluster(measured, train), measured, request), as_json, "planned")


def _measure_live(cluster, token_file, reprofile):
    token = join_token(cluster, token_file)
    from hetlaunch.launcher.cluster_measurement import measure_for_train
    from hetlaunch.launcher.job_driver import UpOptions, new_run_dir
    from hetlaunch.launcher.session import ClusterSession

    options = UpOptions(token=token)
    measured = []

    def measure():
        status = plain_console(stderr=True)  # keep stdout clean for --json
        with ClusterSession(cluster, new_run_dir(cluster, options), options.token or new_token(), status) as s:
            measured.append(measure_for_train(s, cluster.model.to_spec(), reprofile, status))

    with_cluster(measure)
    return measured[0]
