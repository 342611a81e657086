"""The ``impel config`` questionnaire. Prompts, choices and defaults come from the config dataclasses' metadata;
the FSDP questions are every ``FSDPConfig`` field with a ``question``.

Answers are read line by line from stdin, so ``printf 'FSDP\\n2\\n...' | impel config`` drives it from scripts.
An empty answer takes the default shown in brackets. A wrong answer is asked again at a terminal and is an
error when the answers are piped (re-asking would misalign every answer after it).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, NoReturn, TextIO

from impel.config.mesh_sizes import ParallelismSection, check_strategy, check_world_size
from impel.config.run_config import ConfigError, DeepSpeedConfig, FSDPConfig, RunConfig
from impel.config.schema import Section, coerce, option

_LEAVE = object()  # "leave it to the script": the key is not written


def _metas(cls: type) -> dict[str, Mapping[str, object]]:
    return {f.name: f.metadata for f in fields(cls)}


class Prompter:
    def __init__(self, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.interactive = self.stdin.isatty()

    def ask(self, name: str, meta: Any, default: Any, *, leave: bool = False,
            check: Callable[[Any], None] | None = None) -> object:
        """Ask for one field; returns the coerced value (``_LEAVE`` when ``leave`` and the answer is empty)."""
        shown = "leave it to the script" if leave else ("none" if default is None else _show(default))
        choices = f" ({'/'.join(_show(c) for c in meta['choices'])})" if meta["choices"] else ""
        while True:
            self.stdout.write(f"{meta['question'] or meta['help']}{choices} [{shown}]: ")
            self.stdout.flush()
            line = self.stdin.readline()
            if not line:
                raise ConfigError(f"the answers ended before the question for {name!r}; give one answer per line "
                                  "(an empty line takes the default)")
            if not self.interactive:
                self.stdout.write(line if line.endswith("\n") else line + "\n")
            text = line.strip()
            try:
                if not text:
                    return _LEAVE if leave else default
                value = coerce(name, text.replace("-", "_") if meta["choices"] else text, meta, from_text=True)
                if check is not None:
                    check(value)
                return value
            except ConfigError as exc:
                if not self.interactive:
                    raise
                self.stdout.write(f"  {exc}\n")


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def run_questionnaire(prompter: Prompter, default_processes: Callable[[str], int]) -> dict[str, object]:
    """Ask the questions; return the explicit keys of the config file."""
    top = _metas(RunConfig)
    answers: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE"}

    def ask(key: str, default: Any, **kw: Any) -> Any:
        value = prompter.ask(key, top[key], default, **kw)
        if value is not _LEAVE:
            answers[key] = value
        return value

    kind = ask("distributed_type", "NO")
    if kind != "NO":
        machines = ask("num_machines", 1)
        if machines > 1:
            ask("machine_rank", 0, check=lambda r: r < machines or _fail(f"machine_rank={r} must be below "
                                                                            f"num_machines={machines}"))
            ask("main_process_ip", None, check=lambda ip: ip or _fail("main_process_ip is needed"))
            ask("main_process_port", 29500)
            ask("rdzv_backend", "static")
        ask("num_processes", default_processes(kind) * machines,
            check=lambda n: n % machines == 0 or _fail(f"num_processes={n} is not a multiple of num_machines="
                                                       f"{machines}"))
    else:
        answers["num_processes"] = 1
    if kind == "MULTI_CPU":
        answers["use_cpu"] = True
    elif kind != "MULTI_GPU":
        ask("use_cpu", False)
    ask("mixed_precision", None, leave=True)
    ask("gradient_accumulation_steps", None, leave=True)
    if kind == "FSDP":
        answers["fsdp_config"] = _fsdp_questions(prompter)
    elif kind == "DEEPSPEED":
        answers["deepspeed_config"] = _deepspeed_questions(prompter)
    if kind in ("FSDP", "MULTI_CPU", "MULTI_GPU") and answers.get("num_processes", 1) > 1:
        mesh = _parallelism_questions(prompter, kind, answers["num_processes"])
        if mesh:
            answers["parallelism_config"] = mesh
    return answers


_USE_MESH = option(False, "bool", "N-D parallelism", question="Use N-D parallelism (ParallelismConfig: tensor "
                   "parallel, FSDP x TP, HSDP)").metadata


def _parallelism_questions(prompter: Prompter, kind: str, processes: int) -> dict[str, object]:
    """Accelerate asks whether to use the parallelism config, then the sizes: every ParallelismSection field with a
    question, in field order; the sizes must multiply to the number of processes."""
    while prompter.ask("use_parallelism_config", _USE_MESH, False):
        out: dict[str, object] = {}
        ask = _section_asker(prompter, ParallelismSection, out)
        sizes = {f.name: ask(f.name) for f in fields(ParallelismSection) if f.metadata["question"]}
        try:
            ParallelismSection(**sizes).validate()
            check_strategy(sizes, kind)
            check_world_size(sizes, processes, "num_processes")
            return out
        except ConfigError as exc:
            if not prompter.interactive:
                raise
            prompter.stdout.write(f"  {exc}\n")
    return {}


def _fail(message: str) -> NoReturn:
    raise ConfigError(message)


def _section_asker(prompter: Prompter, cls: type[Section], out: dict[str, object]) -> Callable[..., Any]:
    metas = _metas(cls)

    def ask(name: str, **kw: Any) -> Any:
        meta = metas[name]
        value = prompter.ask(cls.PREFIX + name, meta, meta["suggest"], **kw)
        if value is not _LEAVE and value is not None:
            out[cls.PREFIX + name] = value
        return value
    return ask


def _fsdp_questions(prompter: Prompter) -> dict[str, object]:
    """Every FSDPConfig field with a question, in field order; ``ask_if`` fields only after that answer."""
    out: dict[str, object] = {}
    ask = _section_asker(prompter, FSDPConfig, out)
    answers: dict[str, object] = {}
    for f in fields(FSDPConfig):
        condition = f.metadata["ask_if"]
        if f.metadata["question"] and (condition is None or answers.get(condition[0]) == condition[1]):
            answers[f.name] = ask(f.name)
    return out


def _deepspeed_questions(prompter: Prompter) -> dict[str, object]:
    out: dict[str, object] = {}
    ask = _section_asker(prompter, DeepSpeedConfig, out)
    if ask("deepspeed_config_file") is not None:
        ask("zero3_init_flag")
        return out
    stage = ask("zero_stage")
    if ask("offload_optimizer_device") == "nvme":
        ask("offload_optimizer_nvme_path", check=lambda p: p or _fail("an NVMe path is needed"))
    if stage == 3:
        if ask("offload_param_device") == "nvme":
            ask("offload_param_nvme_path", check=lambda p: p or _fail("an NVMe path is needed"))
        ask("zero3_init_flag")
        ask("zero3_save_16bit_model")
    ask("gradient_clipping")
    return out
