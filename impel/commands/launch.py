"""``impel launch``: resolve and validate the whole config, then hand the ranks to torchrun's elastic agent.

Nothing starts until the config (file < flags) validates, the script exists and the strategy's engine is
installed. The ranks receive the explicitly set keys as one JSON variable (``IMPEL_CONFIG``); torchrun
(``torch.distributed.run``, called in-process) starts, watches and restarts them.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from impel.accelerator.resilience import PREEMPTED_EXIT_CODE
from impel.commands import deepspeed_runner, mpirun
from impel.commands.accelerate_flags import accelerate_only_settings, add_accelerate_only_flags
from impel.commands.flags import add_config_flags, explicit_from_flags, explicit_from_flags_list, merge_file_and_flags
from impel.commands.preflight import check_rendezvous
from impel.commands.rank_watch import RankWatch, describe_exit, die_with_this_process
from impel.commands.script_route import accelerate_route_note
from impel.config import environment as env
from impel.config.elastic import check_elastic_launch
from impel.config.environment_settings import describe, environment_settings
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import read_config_file


def add_script_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the script argument as a module (python -m)")
    parser.add_argument("script", metavar="script.py", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("launch", allow_abbrev=False,
                              help="run a training script on every rank of the configured job",
                              description="Run a script under the config file, with flags overriding it.")
    add_config_flags(p)
    add_launcher_flags(p)
    add_accelerate_only_flags(p)
    add_script_arguments(p)
    p.set_defaults(handler=main)


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """``accelerate launch``'s flags about the launcher itself (not the run config), handed to torchrun's agent."""
    g = parser.add_argument_group("launcher (as accelerate launch; passed to torchrun's agent)")
    g.add_argument("-q", "--quiet", action="store_true", help="only the failing rank's traceback, not the agent's "
                   "error summary")
    g.add_argument("--tee", default=None, metavar="STREAMS", help="also write the ranks' stdout (1), stderr (2) or "
                   "both (3) to files under --log_dir")
    g.add_argument("--log_dir", default=None, metavar="DIR", help="where the agent writes the ranks' logs")
    g.add_argument("--no_python", action="store_true", help="run the script as an executable, not with python")
    g.add_argument("--rdzv_conf", default=None, metavar="K=V,...", help="extra rendezvous settings (c10d)")
    g.add_argument("--role", default=None, metavar="NAME", help="the workers' role name in torchrun's agent "
                   "(default: 'default')")
    g.add_argument("--nnodes", default=None, metavar="[MIN:]MAX", help="torchrun's spelling of the machine count: "
                   "N is --num_machines N; MIN:MAX an elastic job (--min_machines MIN --num_machines MAX) that "
                   "continues on the machines left when one is lost")
    g.add_argument("--node_rank", default=None, metavar="R", help="torchrun's spelling of --machine_rank")
    g.add_argument("--stall_warning", default=None, metavar="SECONDS", help="a rank that has waited this long for "
                   "the others in a collective prints which rank it waits for (default 60, 0: off; also "
                   "$IMPEL_STALL_WARNING)")


@dataclass
class LaunchPlan:
    """Everything resolved before a process starts."""

    config: RunConfig
    explicit: dict[str, object]
    nproc_per_node: int
    command: list[str]
    torchrun_args: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    agent_args: list[str] = field(default_factory=list)  # --tee, --log_dir, --no_python, --rdzv_conf for torchrun
    rank_variables: dict[str, str] = field(default_factory=dict)  # Accelerate's variables the ranks also get
    quiet: bool = False
    rank_env: dict[str, str] = field(default_factory=dict)  # launcher flags the ranks read (--stall_warning)

    @property
    def single_process(self) -> bool:
        """Run the script directly: one process, no restarts, nothing only torchrun's agent can do."""
        return (self.config.num_machines == 1 and self.nproc_per_node == 1 and self.config.max_restarts == 0
                and not self.agent_args)


def resolve_config(ns: argparse.Namespace) -> tuple[RunConfig, dict[str, object], list[str]]:
    """defaults < file < environment (``ACCELERATE_*`` variables) < flags, validated; the explicit keys are what
    the ranks receive."""
    path, accelerates = env.config_to_read(ns.config_file)
    from_file = read_config_file(path) if (ns.config_file or os.path.isfile(path)) else {}
    from_environment = environment_settings()  # ACCELERATE_* / IMPEL_* variables: file < environment < flags
    with_environment, notes = merge_file_and_flags(from_file, from_environment)
    merged, flag_notes = merge_file_and_flags(with_environment, with_nnodes(explicit_from_flags(ns), ns))
    notes += flag_notes
    if from_environment:
        notes.insert(0, "from the environment: " + "; ".join(describe()))
    if accelerates:
        notes.insert(0, f"no impel config file: read Accelerate's {path}")
    config = RunConfig.from_dict(merged)
    return config, config.to_dict(explicit_only=True), notes


def with_nnodes(flags: dict[str, object], ns: argparse.Namespace) -> dict[str, object]:
    """torchrun's spellings: ``--nnodes N`` / ``--nnodes MIN:MAX`` as the keys ``num_machines`` / ``min_machines``,
    ``--node_rank R`` as ``machine_rank``; a contradiction with Accelerate's flags raises."""
    values: dict[str, int] = {}
    raw = getattr(ns, "nnodes", None)
    if raw is not None:
        parts = raw.split(":")
        if len(parts) > 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ConfigError(f"--nnodes {raw!r} must be N or MIN:MAX (whole numbers >= 1), e.g. --nnodes 1:2")
        values["num_machines"] = int(parts[-1])
        if len(parts) == 2:
            values["min_machines"] = int(parts[0])
    rank = getattr(ns, "node_rank", None)
    if rank is not None:
        if not rank.strip().isdigit():
            raise ConfigError(f"--node_rank {rank!r} must be a whole number >= 0 (this machine's rank)")
        values["machine_rank"] = int(rank)
    for key, value in values.items():
        if flags.get(key, value) != value:
            given = f"--nnodes {raw}" if key != "machine_rank" else f"--node_rank {rank}"
            raise ConfigError(f"{given} contradicts --{key} {flags[key]}; pass one of them")
    return {**flags, **values}


def _check_engines(config: RunConfig, explicit: dict[str, Any]) -> None:
    if config.distributed_type == "DEEPSPEED":
        if not deepspeed_available():
            raise ConfigError("distributed_type=DEEPSPEED needs DeepSpeed, which is not installed; run "
                              "pip install 'impel[deepspeed]' or use FSDP (--use_fsdp)")
        path = config.deepspeed.deepspeed_config_file
        if path is not None:
            explicit["deepspeed_config"]["deepspeed_config_file"] = _check_json(path)
        from impel.config.deepspeed_json import check_before_launch

        check_before_launch(RunConfig.from_dict(explicit))  # the JSON against the flags, before any rank starts


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _check_json(path: str) -> str:
    """The DeepSpeed JSON loads (the strategy's own reader says what is wrong); the ranks get its absolute path."""
    from impel.config.deepspeed_json import load_json

    load_json(path)
    return os.path.abspath(path)


def _count_devices(config: RunConfig) -> int:
    """Default processes per machine: one per visible GPU for GPU strategies, else one."""
    if config.use_cpu or config.distributed_type in (None, "NO", "MULTI_CPU"):
        return 1
    import torch

    count = torch.cuda.device_count()
    if config.gpu_ids not in (None, "all"):
        count = len([g for g in str(config.gpu_ids).split(",") if g.strip()])
    return max(count, 1)


def _script_command(ns: argparse.Namespace) -> list[str]:
    if ns.module:
        _check_module(ns.script)
        return ["-m", ns.script, *ns.script_args]
    if getattr(ns, "no_python", False):
        _check_program(ns.script)
    elif os.path.isdir(ns.script) and not os.path.isfile(os.path.join(ns.script, "__main__.py")):
        package = os.path.isfile(os.path.join(ns.script, "__init__.py"))
        raise ConfigError(f"script {ns.script!r} is a directory, not a script: " + (
            f"a package runs with -m and a __main__.py (impel launch -m {os.path.basename(ns.script.rstrip('/'))})"
            if package else "pass the script inside it (impel launch DIR/train.py)"))
    elif not os.path.exists(ns.script):
        raise ConfigError(f"script {ns.script!r} does not exist (working directory {os.getcwd()}); check the path, "
                          "or pass -m for a module")
    return [ns.script, *ns.script_args]


def _check_module(name: str) -> None:
    """``-m name`` runs as ``python -m`` does, which finds modules in the working directory too."""
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name.split(".")[0])
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        raise ConfigError(f"module {name!r} cannot be found (working directory {os.getcwd()}); check the name or "
                          "install its package")
    where = spec.submodule_search_locations
    if "." not in name and where is not None and \
            not any(os.path.isfile(os.path.join(d, "__main__.py")) for d in where):
        raise ConfigError(f"module {name!r} is a package without a __main__.py, so python -m cannot run it; add "
                          f"{name}/__main__.py, or pass the module to run (-m {name}.train)")


def _check_program(script: str) -> None:
    """``--no_python`` runs the script as a program, found as the shell would (a path, or a name on PATH)."""
    import shutil

    found = shutil.which(script) if os.sep not in script else (script if os.access(script, os.X_OK) and
                                                                 os.path.isfile(script) else None)
    if found is None:
        hint = f"./{script}" if os.path.isfile(script) and os.access(script, os.X_OK) else "chmod +x it"
        raise ConfigError(f"--no_python runs {script!r} as a program, but it is not an executable file on PATH "
                          f"or at that path; drop --no_python to run it with python, or {hint}")


def plan_launch(ns: argparse.Namespace) -> LaunchPlan:
    """Resolve and check everything; raises ConfigError before any process exists."""
    config, explicit, notes = resolve_config(ns)
    rank_env = _rank_environment(ns)
    check_elastic_launch(config)
    if config.mpirun_hostfile:
        mpirun.check(config)
        _check_no_agent(ns, "--mpirun_hostfile", "mpirun")
    if config.num_machines > 1 or (config.num_processes or 1) > 1:
        check_rendezvous(config)  # an unknown host or a taken port: one line now, not a hang or a traceback later
    command = _script_command(ns)
    notes += [line for line in [accelerate_route_note(command)] if line]  # a stock TRL/Accelerate script: say so
    if config.distributed_type == "AUTO":
        config, explicit = _choose_strategy(config, explicit, notes)
    _check_engines(config, explicit)
    if config.gpu_ids not in (None, "all") and config.use_cpu:
        raise ConfigError(f"gpu_ids={config.gpu_ids!r} has no effect with use_cpu=true; remove one of them")
    if config.num_processes is None:
        nproc = _count_devices(config)
    else:
        nproc = config.num_processes // config.num_machines
    _check_mesh(config, nproc * config.num_machines)
    if deepspeed_runner.check(config, nproc):  # DeepSpeed's runner starts the hostfile's machines
        _check_no_agent(ns, "--deepspeed_hostfile", "DeepSpeed's runner")
    rank_variables = {**accelerate_only_settings(ns), **_rank_variables(config, ns),
                      **_cpu_ranks(config, nproc * config.num_machines)}
    plan = LaunchPlan(config, explicit, nproc, command, notes=notes, agent_args=_agent_arguments(ns),
                      quiet=bool(getattr(ns, "quiet", False)), rank_variables=rank_variables, rank_env=rank_env)
    plan.torchrun_args = torchrun_arguments(plan)
    if rank_env and plan.config.num_machines * nproc == 1:
        raise ConfigError("--stall_warning has no effect on one process (no rank waits for another); remove it, or "
                          "launch several processes (--num_processes)")
    return plan


def _check_no_agent(ns: argparse.Namespace, flag: str, starter: str) -> None:
    """mpirun or DeepSpeed's runner, not torchrun's agent, starts the ranks; the agent's settings would do nothing."""
    given = [f"--{name}" for name in ("tee", "log_dir", "rdzv_conf", "role") if getattr(ns, name, None) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} set(s) torchrun's agent, which does not run with {flag} "
                          f"({starter} starts the ranks and prints their output): drop them")


def _rank_variables(config: RunConfig, ns: argparse.Namespace) -> dict[str, str]:
    """Accelerate's variables as ``accelerate launch`` sets them, for code that reads them: ``--debug``
    (``ACCELERATE_DEBUG_MODE``, set either way so a shell's value cannot contradict the config: collectives check
    shapes first), ``--use_parallelism_config`` (``ACCELERATE_USE_PARALLELISM_CONFIG``: ``Accelerator()`` builds a
    ``ParallelismConfig()``) and the ``parallelism_config`` section (``PARALLELISM_CONFIG_*``, which it reads)."""
    out = {"ACCELERATE_DEBUG_MODE": "true" if config.debug else "false"}
    if getattr(ns, "use_parallelism_config", False):
        out["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    if config.parallelism_config is not None:
        out.update(env.parallelism_exports(config.parallelism_config))
    return out


def _cpu_ranks(config: RunConfig, world: int) -> dict[str, str]:
    """Several ranks that run on CPUs get ``ACCELERATE_USE_CPU=true``, as ``accelerate launch --cpu`` sets it: code
    that asks Accelerate's own state for the world (transformers' ``TrainingArguments`` on the hf Trainer route)
    otherwise sees one process per rank on a machine without GPUs. A value the user exported is kept."""
    if world < 2 or env.read_variables(["ACCELERATE_USE_CPU"]):
        return {}
    on_cpu = config.use_cpu or config.distributed_type == "MULTI_CPU"
    if not on_cpu:
        import torch

        on_cpu = not torch.cuda.is_available()
    return {"ACCELERATE_USE_CPU": "true"} if on_cpu else {}


def _check_mesh(config: RunConfig, world: int) -> None:
    """The parallelism_config sizes multiply to the number of processes this launch starts (before any starts)."""
    from impel.config.mesh_sizes import check_world_size, total_size

    section = config.parallelism_config
    if section is not None and total_size(section.sizes()) > 1:
        check_world_size(section.sizes(), world, "num_processes")


def _rank_environment(ns: argparse.Namespace) -> dict[str, str]:
    raw = getattr(ns, "stall_warning", None)
    if raw is None:
        return {}
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"--stall_warning={raw!r} must be a number of seconds >= 0 (0 turns the stall warning off)")
    return {env.STALL_WARNING_VAR: str(seconds)}


def _agent_arguments(ns: argparse.Namespace) -> list[str]:
    args: list[str] = []  # (--dynamo_* are run-config flags: the dynamo_config section, see impel.runtime.step.compile)
    if getattr(ns, "tee", None) is not None:
        if ns.tee not in ("0", "1", "2", "3"):
            raise ConfigError(f"--tee {ns.tee} is not one of 0 (none), 1 (stdout), 2 (stderr), 3 (both)")
        args += ["--tee", ns.tee]
    if getattr(ns, "log_dir", None) is not None:
        args += ["--log_dir", ns.log_dir]
    if getattr(ns, "no_python", False):
        args.append("--no_python")
    if getattr(ns, "role", None) is not None:
        args += ["--role", ns.role]
    if getattr(ns, "rdzv_conf", None) is not None:
        pairs = [p.partition("=") for p in ns.rdzv_conf.split(",")]
        if not all(key.strip() and eq and value.strip() for key, eq, value in pairs):
            raise ConfigError(f"--rdzv_conf {ns.rdzv_conf!r} must be KEY=VALUE pairs separated by commas, e.g. "
                              "--rdzv_conf join_timeout=600,last_call_timeout=30")
        args += ["--rdzv_conf", ns.rdzv_conf]
    return args


def _device_memory(config: RunConfig, per_machine: int) -> str:
    if config.device_memory:
        return config.device_memory
    if not config.use_cpu:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(0).total_memory)
    with open("/proc/meminfo", encoding="ascii") as fh:
        available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    return str(available // max(per_machine, 1))


def _choose_strategy(config: RunConfig, explicit: dict[str, object],
                     notes: list[str]) -> tuple[RunConfig, dict[str, object]]:
    """distributed_type AUTO: estimate every strategy for --auto_model and keep the cheapest that fits."""
    from impel.commands.estimate import plan
    from impel.commands.planning.estimate import LAUNCH_FLAGS

    assert config.auto_model is not None  # RunConfig.validate() refuses AUTO without it
    world = config.num_processes or config.num_machines * _count_devices(config)
    result = plan(config.auto_model, {"world": world, "machines": config.num_machines,
                                      "mixed_precision": config.mixed_precision},
                  _device_memory(config, world // config.num_machines))
    if result["recommended"] is None:
        raise ConfigError(f"--strategy auto: {result['why']}")
    chosen = {k: v for k, v in explicit.items() if k not in ("distributed_type", "auto_model", "device_memory")}
    chosen.update(explicit_from_flags_list(LAUNCH_FLAGS[result["recommended"]]))  # the keys selecting it
    notes.append(f"--strategy auto chose {result['recommended']} for {result['model']} on {world} rank(s): "
                 f"{result['why']}")
    config = RunConfig.from_dict(chosen)
    return config, config.to_dict(explicit_only=True)


def torchrun_arguments(plan: LaunchPlan) -> list[str]:
    cfg = plan.config
    args = ["--nnodes", str(cfg.num_machines), "--nproc_per_node", str(plan.nproc_per_node),
            "--max_restarts", str(cfg.max_restarts), "--monitor_interval", str(cfg.monitor_interval)]
    if cfg.num_machines == 1 and cfg.main_process_port is None:
        # One machine and no port asked for: the agent binds a free port itself (c10d); static with port 0 hangs.
        args += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", "--rdzv_id", uuid.uuid4().hex]
    else:
        host = cfg.main_process_ip or "127.0.0.1"
        port = cfg.main_process_port or 29500
        if cfg.min_machines is not None:  # elastic: c10d, the rendezvous store on machine 0 (fixed, not guessed)
            args[1] = f"{cfg.min_machines}:{cfg.num_machines}"
            args += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:{port}", "--rdzv_id", "impel"]
        elif cfg.rdzv_backend == "static":  # same_network: torchrun's two spellings, as accelerate launch picks
            where = ["--master_addr", host, "--master_port", str(port)] if cfg.same_network or cfg.num_machines == 1 \
                else ["--rdzv_endpoint", f"{host}:{port}"]
            args += ["--rdzv_backend", "static", *where, "--node_rank", str(cfg.machine_rank)]
        else:
            args += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:{port}", "--rdzv_id", "impel"]
    args += _with_host_role(plan.agent_args, cfg) if cfg.min_machines is not None else plan.agent_args
    if plan.command[0] == "-m":
        args.append("--module")
        return args + plan.command[1:]
    return args + plan.command


def _with_host_role(agent_args: list[str], cfg: RunConfig) -> list[str]:
    """Elastic: machine 0 hosts the rendezvous store and the others connect (``is_host`` in ``--rdzv_conf``),
    instead of torchrun guessing from host names, which on one host (or behind NAT) picks several or none."""
    role = f"is_host={1 if cfg.machine_rank == 0 else 0}"
    if "--rdzv_conf" not in agent_args:
        return [*agent_args, "--rdzv_conf", role]
    at = agent_args.index("--rdzv_conf") + 1
    given = agent_args[at]
    merged = given if "is_host=" in given else f"{role},{given}"
    return [*agent_args[:at], merged, *agent_args[at + 1:]]


def main(ns: argparse.Namespace) -> int:
    plan = plan_launch(ns)
    for note in plan.notes:
        print(f"impel launch: {note}", file=sys.stderr)
    variables = env.launch_environment(plan.explicit, plan.config.num_cpu_threads_per_process, plan.config.gpu_ids,
                                       plan.nproc_per_node)
    variables.update(plan.rank_variables)
    variables.update(plan.rank_env)
    if plan.config.mpirun_hostfile:  # mpirun starts the ranks on the hostfile's hosts (impel.commands.mpirun)
        script = plan.command if "--no_python" in plan.agent_args else [sys.executable, *plan.command]
        return mpirun.run(plan.config, plan.nproc_per_node, script, variables)
    if deepspeed_runner.uses_runner(plan.config):  # DeepSpeed's runner starts every machine's ranks
        return deepspeed_runner.run(plan.config, plan.nproc_per_node, plan.command, "--no_python" in plan.agent_args,
                                    variables)
    if plan.single_process:
        return _run_single(plan, variables)
    if plan.quiet:
        import logging

        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    cfg = plan.config
    if cfg.num_machines > 1 and cfg.machine_rank > 0:  # machine 0 hosts the rendezvous: wait for it, saying so
        from impel.commands.host_wait import join_timeout, wait_for_machine_0

        if not wait_for_machine_0(cfg.main_process_ip or "127.0.0.1", cfg.main_process_port or 29500,
                                  join_timeout(plan.agent_args)):
            return 1
    return run_torchrun(plan.torchrun_args, variables)


def _run_single(plan: LaunchPlan, variables: dict[str, str]) -> int:
    """One process, no restarts: run it directly (torchrun's agent would only add start-up time).

    SIGTERM is passed on to the script and the launcher waits, so a preempted run can save its checkpoint.
    """
    proc = subprocess.Popen([sys.executable, *plan.command], env=variables, preexec_fn=die_with_this_process())
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                continue  # the script got SIGINT too (same process group): wait for it to finish
    finally:
        signal.signal(signal.SIGTERM, previous)
    _explain(code, None)
    return code if code >= 0 else 128 - code


def _explain(code: int, rank: int | None, first: tuple[int, str, int] | None = None) -> None:
    """The launcher's last line. ``first``: (rank, how) of the rank that left first; when it is another rank than
    the failed one, it left early (e.g. ``sys.exit(0)``) and its peers failed in their next collective."""
    if code == PREEMPTED_EXIT_CODE:
        print(f"impel launch: preempted: the ranks saved a checkpoint and stopped (exit code {PREEMPTED_EXIT_CODE}); "
              "run the same command again to continue", file=sys.stderr)
    elif rank is not None and first is not None and first[0] != rank:
        print(f"impel launch: rank {first[0]} left first, by {first[1]}, while the other ranks were still running "
              f"(every rank must reach the same collectives); rank {rank} then failed with {describe_exit(code)} "
              "(its output is above); the job stopped", file=sys.stderr)
    elif rank is not None:
        print(f"impel launch: rank {rank} failed with {describe_exit(code)} (its output is above); the job stopped",
              file=sys.stderr)


def run_torchrun(arguments: list[str], variables: dict[str, str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    watch = RankWatch()
    env.apply_environment({**variables, env.RANK_EXIT_DIR_VAR: watch.exit_dir})
    try:
        with watch.installed():
            torchrun.run(torchrun.parse_args(arguments))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        first = watch.first_exit()
        _explain(code, rank, first)
        if first is not None and first[0] != rank and first[2] != 0:
            code = first[2]  # the job's exit code is the cause's (a rank's sys.exit(3)), not its peer's failure
        return 128 - code if code < 0 else code
    except SignalException as exc:
        print(f"impel launch: stopped by {exc.sigval.name}; the ranks were told to stop (with auto_resume they save a "
              "checkpoint at their next step boundary: run the same command again to continue)", file=sys.stderr)
        return 128 + int(exc.sigval)
    except RendezvousError as exc:  # c10d: the store on the machine of rank 0 is gone or was never reached
        where = arguments[arguments.index("--rdzv_endpoint") + 1] if "--rdzv_endpoint" in arguments else "?"
        print(f"impel launch: the rendezvous at {where} failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
              "machine 0 (--machine_rank 0) hosts it, so when that machine is gone or unreachable the job cannot "
              "go on: start machine 0 again, then the others (with --auto_resume the job continues from its last "
              "checkpoint)", file=sys.stderr)
        return 1
    return 0
