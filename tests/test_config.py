import pytest

from megaloom.config import ConfigError, describe_keys, load_config


def test_defaults_and_preset():
    cfg = load_config(None, [])
    assert cfg.model.preset == "tiny" and cfg.model.arch == "llama"
    cfg = load_config(None, ["model.preset=llama3-8b"])
    assert cfg.model.n_layers == 32 and cfg.model.d_model == 4096 and cfg.model.n_kv_heads == 8


def test_overrides_win_over_preset_and_types_are_coerced():
    cfg = load_config(None, ["model.preset=gpt2-124m", "model.n_layers=2", "train.lr=1e-3", "parallel.sp=true",
                             "data.paths=a,b", "data.weights=[1, 2]"])
    assert cfg.model.n_layers == 2 and cfg.model.d_model == 768
    assert cfg.train.lr == 1e-3 and cfg.parallel.sp is True
    assert cfg.data.paths == ["a", "b"] and cfg.data.weights == [1.0, 2.0]


def test_yaml_file_then_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  preset: tiny\n  n_layers: 3\ntrain:\n  steps: 7\n")
    cfg = load_config(f, ["train.steps=9"])
    assert cfg.model.n_layers == 3 and cfg.train.steps == 9


@pytest.mark.parametrize("override, fragment", [
    ("train.stpes=5", "Did you mean 'train.steps'"),
    ("modle.n_layers=2", "Did you mean 'model.n_layers'"),
    ("train.steps=abc", "train.steps: expected an integer"),
    ("train.steps=0", "train.steps must be >= 1"),
    ("train.precision=fp64", "train.precision"),
    ("model.preset=llama9", "model.preset: unknown preset"),
    ("parallel.zero=4", "parallel.zero"),
    ("model.n_heads=5", "divisible by model.n_heads"),
    ("train.micro_batch_size=3", "multiple of train.micro_batch_size"),
    ("train.seq_len=4096", "exceeds model.max_seq_len"),
    ("parallel.sp=maybe", "expected true or false"),
    ("noequals", "key=value"),
    ("model.head_dim=-1", "model.head_dim must be >= 0"),
    ("model.head_dim=33", "head dim (model.head_dim) must be even for RoPE"),
])
def test_bad_input_names_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("'", "'").replace(")", r"\)")):
        load_config(None, [override])


def test_head_dim_frees_d_model_from_dividing_by_the_heads():
    """With model.head_dim the heads need not tile d_model (q/k/v project to heads x head_dim)."""
    from megaloom.config import resolved_head_dim

    cfg = load_config(None, ["model.n_heads=5", "model.n_kv_heads=5", "model.head_dim=32"])
    assert resolved_head_dim(cfg.model) == 32
    assert resolved_head_dim(load_config(None, []).model) == 128 // 4  # 0: d_model / n_heads


def test_unknown_yaml_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trian:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="Did you mean 'train'"):
        load_config(f)


def test_describe_lists_every_section():
    text = describe_keys()
    for key in ["model.preset", "parallel.tp", "train.steps", "data.paths", "checkpoint.every", "run.dir"]:
        assert key in text


def test_yaml_round_trip():
    import yaml

    from megaloom.config import config_from_dict

    cfg = load_config(None, ["model.n_layers=3", "data.paths=x"])
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize("overrides,fragment", [
    (["model.preset=mixtral-tiny", "parallel.ep=3"], "parallel.ep=3 does not divide model.n_experts=8"),
    (["model.preset=mixtral-tiny", "model.top_k=9"], "model.top_k (9)"),
])
def test_moe_layout_errors_name_the_settings(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_expert_parallelism_without_experts_is_refused_before_start(tmp_path):
    from megaloom.train import train

    with pytest.raises(ConfigError, match="model.moe_every=0"):
        train(load_config(None, ["parallel.ep=2", f"run.dir={tmp_path}"]))
