"""Arguments of Accelerate's plugins that impel accepts by name and refuses when set, each with the reason and
what to use instead (so a setting never passes silently). The plugins in :mod:`impel.config.plugins` call
:func:`refuse_set` from ``__post_init__``."""
from __future__ import annotations

from impel.config.run_config import ConfigError

_FSDP1 = "an FSDP1 setting; impel runs FSDP2 (fully_shard), which has no such option"
FSDP_REFUSED: dict[str, tuple[object, str]] = {  # argument -> (the value that means "not set", why and what instead)
    "ignored_modules": (None, "not supported yet: every module is sharded; freeze the parameters "
                              "(requires_grad=False) or keep the module out of the model you prepare"),
    "state_dict_config": (None, _FSDP1 + "; choose full or sharded checkpoints with state_dict_type"),
    "optim_state_dict_config": (None, _FSDP1 + "; choose full or sharded checkpoints with state_dict_type"),
    "limit_all_gathers": (True, _FSDP1 + " (FSDP2 does not rate-limit its all-gathers); leave it out"),
    "param_init_fn": (None, "not supported: impel materialises meta weights itself; use "
                            "cpu_ram_efficient_loading=True (rank 0 reads the weights) or init_empty_weights"),
    "activation_checkpointing_offload": (None, "not supported: use activation_checkpointing=True (recomputed, "
                                               "not offloaded)"),
}
DEEPSPEED_REFUSED: dict[str, tuple[object, str]] = {
    "transformer_moe_cls_names": (None, "not wired: call deepspeed.utils.set_z3_leaf_modules(model, [...]) on the "
                                        "model before accelerator.prepare"),
    "enable_msamp": (None, "impel has no fp8 / MS-AMP mode; use mixed_precision='bf16'"),
    "msamp_opt_level": (None, "impel has no fp8 / MS-AMP mode; use mixed_precision='bf16'"),
}


def refuse_set(plugin: object, refused: dict[str, tuple[object, str]]) -> None:
    """A ConfigError naming the first of ``refused`` that ``plugin`` sets, with its reason."""
    for name, (unset, reason) in refused.items():
        value = getattr(plugin, name)
        if value is not unset and value != unset and not (unset is None and value is False):
            raise ConfigError(f"{type(plugin).__name__}({name}={value!r}): {reason}")
