"""ZeroConfig: validation, messages, file loading and what each stage implies."""

import ast
import dataclasses
import inspect
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_strategy import config as config_module
from zero_strategy.config import ZeroConfig
from zero_strategy.policy import Policies

FIELDS = [f.name for f in dataclasses.fields(ZeroConfig)]

EXPECTED_DEFAULTS = {
    "stage": 2,
    "precision": "fp32",
    "reduce_dtype": None,
    "autocast": False,
    "reduce_bucket_size": 5_000_000,
    "allgather_bucket_size": 25_000_000,
    "overlap_comm": True,
    "no_sync_reduces": True,
    "step_clears_gradients": True,
    "prefetch_bucket_size": 5_000_000,
    "param_persistence_threshold": 100_000,
    "unit_modules": ("auto",),
    "min_gather_numel": 1_000_000,
    "loss_scale": 0.0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1.0,
    "gradient_clipping": 0.0,
    "offload_optimizer": "none",
    "offload_param": "none",
    "host_optimizer_step": "fused",
    "elementwise_optimizers": (),
    "nvme_path": None,
    "nvme_inflight_bytes": 256 * 2**20,
    "activation_checkpointing": (),
    "offload_activations": False,
    "ranks_per_node": None,
    "secondary_partition": None,
    "weight_quantization": None,
    "gradient_quantization": None,
    "quantization_block_size": 256,
    "collective_timeout": 600.0,
    "check_call_order": False,
    "on_min_loss_scale": "raise",
    "check_finite_loss": False,
    "exact_frozen_weights": True,
    "keep_gathered_methods": ("generate",),
    "keep_gathered_max_bytes": 4 * 2**30,
}


def test_defaults_are_valid_and_as_documented():
    cfg = ZeroConfig()
    assert {name: getattr(cfg, name) for name in FIELDS} == EXPECTED_DEFAULTS


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZeroConfig")
    documented = set()
    for node, following in zip(cls.body, cls.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
                and following.value.value.strip()):
            documented.add(node.target.id)
    assert set(FIELDS) - documented == set()


@pytest.mark.parametrize("typo, closest", [
    ("reduce_bucket_sze", "reduce_bucket_size"),
    ("stgae", "stage"),
    ("overlap_com", "overlap_comm"),
    ("gradient_clip", "gradient_clipping"),
])
def test_unknown_key_names_the_closest_valid_key(typo, closest):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_dict({typo: 1})
    assert repr(typo) in str(info.value)
    assert f"did you mean {closest!r}" in str(info.value)


def test_unknown_key_with_nothing_close_lists_valid_keys():
    with pytest.raises(ValueError, match="valid keys are") as info:
        ZeroConfig.from_dict({"zzzzzzzz": 1})
    assert "reduce_bucket_size" in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("stage", 4),
    ("stage", -1),
    ("stage", 2.5),
    ("stage", "two"),
    ("stage", True),
    ("precision", "fp8"),
    ("precision", 8),
    ("ranks_per_node", 0),
    ("secondary_partition", "gpu"),
    ("weight_quantization", "int4"),
    ("gradient_quantization", "fp8"),
    ("quantization_block_size", 4),
    ("reduce_dtype", "int8"),
    ("reduce_bucket_size", -1),
    ("reduce_bucket_size", 0),
    ("allgather_bucket_size", 0),
    ("prefetch_bucket_size", -5),
    ("param_persistence_threshold", -1),
    ("min_gather_numel", -1),
    ("keep_gathered_max_bytes", -1),
    ("keep_gathered_max_bytes", "4 GiB"),
    ("keep_gathered_methods", ["generate()"]),
    ("keep_gathered_methods", [3]),
    ("keep_gathered_methods", {"generate": True}),
    ("overlap_comm", "yes"),
    ("overlap_comm", 1),
    ("unit_modules", []),
    ("unit_modules", ["auto", "GPT2Block"]),
    ("unit_modules", [3]),
    ("loss_scale", -1.0),
    ("loss_scale", float("nan")),
    ("initial_scale_power", 65),
    ("loss_scale_window", 0),
    ("hysteresis", 0),
    ("min_loss_scale", 0.0),
    ("loss_scale", 2e-156),  # 1/scale is infinite in fp32: every unscaled gradient would be NaN
    ("loss_scale", 1e39),
    ("min_loss_scale", 1e-300),
    ("collective_timeout", 2e7),
    ("gradient_clipping", -0.5),
    ("gradient_clipping", "inf"),
])
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        ZeroConfig(**{field: value})
    assert field in str(info.value)


def test_wrong_type_message_names_value_and_expected_type():
    with pytest.raises(ValueError) as info:
        ZeroConfig(reduce_bucket_size="lots")
    message = str(info.value)
    assert "reduce_bucket_size" in message and "'lots'" in message and "integer" in message


@pytest.mark.parametrize("alias, canonical", [
    ("32", "fp32"), ("float32", "fp32"), ("FP32", "fp32"), (32, "fp32"),
    ("bf16-mixed", "bf16"), ("bfloat16", "bf16"),
    ("16-mixed", "fp16"), ("fp16-mixed", "fp16"), ("float16", "fp16"), ("16", "fp16"),
])
def test_precision_aliases_normalise(alias, canonical):
    assert ZeroConfig(precision=alias).precision == canonical
    assert ZeroConfig(reduce_dtype=alias).reduce_dtype == canonical


@pytest.mark.parametrize("value, expected", [
    (5e8, 500_000_000), ("5e8", 500_000_000), ("25_000_000", 25_000_000), (" 7 ", 7),
])
def test_integer_fields_accept_whole_floats_and_numeric_strings(value, expected):
    cfg = ZeroConfig(reduce_bucket_size=value)
    assert cfg.reduce_bucket_size == expected and type(cfg.reduce_bucket_size) is int


def test_unit_modules_accepts_str_or_list_and_stores_a_tuple():
    assert ZeroConfig.from_dict({"unit_modules": "GPT2Block"}).unit_modules == ("GPT2Block",)
    cfg = ZeroConfig.from_dict({"unit_modules": ["GPT2Block", "LlamaDecoderLayer"]})
    assert cfg.unit_modules == ("GPT2Block", "LlamaDecoderLayer")
    hash(cfg)  # a frozen config must stay hashable after normalisation


def test_from_file_json(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"stage": 3, "precision": "bf16-mixed",
                                "reduce_bucket_size": 5e8}))
    cfg = ZeroConfig.from_file(path)
    assert (cfg.stage, cfg.precision, cfg.reduce_bucket_size) == (3, "bf16", 500_000_000)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_from_file_yaml_reads_5e8(tmp_path, suffix):
    # PyYAML (YAML 1.1) parses 5e8 as the string "5e8", not a number.
    path = tmp_path / f"zero{suffix}"
    path.write_text("stage: 1\nreduce_bucket_size: 5e8\noverlap_comm: false\n"
                    "unit_modules: [GPT2Block]\n")
    cfg = ZeroConfig.from_file(str(path))
    assert cfg.reduce_bucket_size == 500_000_000
    assert (cfg.stage, cfg.overlap_comm, cfg.unit_modules) == (1, False, ("GPT2Block",))


def test_from_file_errors_name_the_path(tmp_path):
    bad_suffix = tmp_path / "zero.toml"
    bad_suffix.write_text("stage = 1")
    with pytest.raises(ValueError, match="unsupported") as info:
        ZeroConfig.from_file(bad_suffix)
    assert str(bad_suffix) in str(info.value)

    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError) as info:
        ZeroConfig.from_file(missing)
    assert str(missing) in str(info.value)

    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping") as info:
        ZeroConfig.from_file(not_a_mapping)
    assert str(not_a_mapping) in str(info.value)

    broken = tmp_path / "broken.json"
    broken.write_text("{stage: ")
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_file(broken)
    assert str(broken) in str(info.value)


def test_config_is_frozen():
    cfg = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 3


def test_replace_validates_and_to_dict_round_trips():
    cfg = ZeroConfig(stage=3, precision="fp16", unit_modules=("Block",))
    assert cfg.replace(stage=1).stage == 1 and cfg.stage == 3
    with pytest.raises(ValueError, match="stage"):
        cfg.replace(stage=7)
    with pytest.raises(ValueError, match="did you mean 'hysteresis'"):
        cfg.replace(hysterisis=3)
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert ZeroConfig.from_dict(data) == cfg


def test_coerce(tmp_path):
    assert ZeroConfig.coerce(None) == ZeroConfig()
    cfg = ZeroConfig(stage=1)
    assert ZeroConfig.coerce(cfg) is cfg
    assert ZeroConfig.coerce({"stage": 1}) == cfg
    path = tmp_path / "z.yaml"
    path.write_text("stage: 1\n")
    assert ZeroConfig.coerce(path) == cfg and ZeroConfig.coerce(str(path)) == cfg
    with pytest.raises(TypeError):
        ZeroConfig.coerce(3)


# Stage -> (optimizer state, gradients, parameters) partitioned, as in the paper's P_os,
# P_os+g, P_os+g+p.
@pytest.mark.parametrize("stage, expected", [
    (0, (False, False, False)),
    (1, (True, False, False)),
    (2, (True, True, False)),
    (3, (True, True, True)),
])
def test_stage_implies_what_is_partitioned(stage, expected):
    sp = Policies.from_config(ZeroConfig(stage=stage)).stage
    assert (sp.partitions_optimizer_state, sp.shards_gradients, sp.shards_parameters) == expected


@pytest.mark.parametrize("precision, dtype, mixed, scaling", [
    ("fp32", torch.float32, False, False),
    ("bf16", torch.bfloat16, True, False),
    ("fp16", torch.float16, True, True),
])
def test_precision_properties(precision, dtype, mixed, scaling):
    pp = Policies.from_config(ZeroConfig(precision=precision)).precision
    assert pp.compute_dtype == dtype and pp.reduce_dtype == dtype
    assert (pp.mixed, pp.loss_scaling) == (mixed, scaling)


def test_reduce_dtype_overrides_grad_reduce_dtype():
    pp = Policies.from_config(ZeroConfig(precision="bf16", reduce_dtype="float32")).precision
    assert pp.compute_dtype == torch.bfloat16 and pp.reduce_dtype == torch.float32


_any_value = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=4),
    st.sampled_from(["5e8", "1e400", "nan", "-inf", "2", "fp16", "bf16-mixed", "auto",
                     "GPT2Block", "25_000_000", "0x10", ""]),
    st.lists(st.one_of(st.text(max_size=6), st.integers()), max_size=3),
    st.tuples(st.text(max_size=6)),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), _any_value, max_size=len(FIELDS)))
def test_random_input_gives_a_valid_config_or_value_error(data):
    try:
        cfg = ZeroConfig.from_dict(data)
    except ValueError:
        return
    # Whatever got through must be normalised to the documented types and ranges.
    assert cfg.stage in (0, 1, 2, 3)
    assert cfg.precision in ("fp32", "bf16", "fp16")
    assert cfg.reduce_dtype in (None, "fp32", "bf16", "fp16")
    assert isinstance(cfg.overlap_comm, bool)
    for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                 "param_persistence_threshold", "min_gather_numel", "initial_scale_power",
                 "loss_scale_window", "hysteresis"):
        assert type(getattr(cfg, name)) is int
    for name in ("loss_scale", "min_loss_scale", "gradient_clipping"):
        assert math.isfinite(getattr(cfg, name))
    assert isinstance(cfg.unit_modules, tuple) and cfg.unit_modules
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_offload_and_activation_checkpointing_fields():
    cfg = ZeroConfig.from_dict({"offload_optimizer": "cpu", "activation_checkpointing": "GPT2Block", "offload_activations": True})
    assert cfg.offload_optimizer == "cpu" and cfg.activation_checkpointing == ("GPT2Block",)
    with pytest.raises(ValueError, match="offload_optimizer must be 'none', 'cpu' or 'nvme'"):
        ZeroConfig(offload_optimizer="gpu")
    with pytest.raises(ValueError, match="needs activation_checkpointing"):
        ZeroConfig(offload_activations=True)


@pytest.mark.parametrize("scale", [2.0 ** -126, 2.0 ** 126])
def test_extreme_accepted_static_loss_scales_keep_parameters_finite(scale):
    """The bounds of the accepted static loss scale are where unscaling stays finite in fp32:
    one fp16 step at either bound leaves every parameter finite (an overflowing step is
    skipped, a vanishing one adds nothing)."""
    import torch
    import zero_strategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero_strategy.initialize(model, optimizer, ZeroConfig(stage=0, precision="fp16", loss_scale=scale))
    try:
        loss = model(torch.randn(2, 8)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.close(unshard=True)
        for p, b in zip(model.parameters(), before):
            assert torch.isfinite(p).all()
            assert p.dtype == b.dtype
    finally:
        engine.close()


@pytest.mark.parametrize("changes, needs", [
    (dict(stage=2, secondary_partition="node"), "needs stage 3"),
    (dict(stage=1, weight_quantization="int8"), "needs stage 3"),
    (dict(stage=1, gradient_quantization="int4"), "needs stage 2 or 3"),
])
def test_zero_plus_plus_options_name_the_stage_they_need(changes, needs):
    with pytest.raises(ValueError, match=needs):
        ZeroConfig(**changes)
    assert ZeroConfig(stage=3, **{k: v for k, v in changes.items() if k != "stage"})  # accepted at stage 3
