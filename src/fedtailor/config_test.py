import pytest

from fedtailor.config import COMPACT_VARIANTS, ConfigError, load_config


def test_defaults_are_the_papers_setting():
    cfg = load_config()
    assert cfg.method.name == "compact"
    assert (cfg.data.num_clients, cfg.data.num_unseen, cfg.data.alpha, cfg.data.context_size) == (50, 10, 0.5, 333)
    assert (cfg.federation.rounds, cfg.federation.clients_per_round) == (500, 2)
    m = cfg.method
    assert (m.coef_dim, m.hidden_dim, m.lr, m.privacy.batch_size, m.privacy.clip, m.privacy.delta) == (
        16384,
        100,
        0.1,
        333,
        1.0,
        1e-5,
    )


def test_overrides_parse_toml_literals(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('name = "x"\n[method]\nname = "fedavg"\nlr = 0.5\n')
    cfg = load_config(path, ["federation.rounds=7", "method.lr=0.25", 'data.dataset="digits"'])
    assert (cfg.federation.rounds, cfg.method.lr, cfg.data.dataset, cfg.name) == (7, 0.25, "digits", "x")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ('method.name="fedx"', "method.name: unknown method 'fedx'"),
        ("data.alpha=-1", "data.alpha: Input should be greater than 0"),
        ('data.scheme="foo"', "'dirichlet-equal', 'dirichlet-per-class' or 'iid'"),
        ("data.typo=1", "data.typo: unknown field"),
        ("federation.clients_per_round=45", "exceeds the number of seen clients"),
        ('method.variant="nope"', "method.variant: Input should be 'ours-dg'"),
        ("method.privacy.epsilon=0", "method.privacy.epsilon"),
        ("rounds", "--set expects key=value"),
    ],
)
def test_bad_fields_are_named_with_the_allowed_values(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_variant_fills_the_axes_and_conflicts_are_refused():
    for variant, axes in COMPACT_VARIANTS.items():
        extra = ['method.replay_from="somewhere"'] if variant == "replay" else []
        m = load_config(None, [f'method.variant="{variant}"', *extra]).method
        assert {k: getattr(m, k) for k in axes} == axes
    with pytest.raises(ConfigError, match="variant 'global' sets space='full'"):
        load_config(None, ['method.variant="global"', 'method.space="coefficient"'])
    with pytest.raises(ConfigError, match="without noise"):
        load_config(None, ['method.variant="ours-lrsuq"', "method.privacy.epsilon=inf"])


def test_missing_file_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    y = tmp_path / "c.yaml"
    y.write_text("seed: 43\nfederation:\n  rounds: 3\n")
    cfg = load_config(y)
    assert (cfg.seed, cfg.federation.rounds) == (43, 3)


def test_validation_mode_and_the_unseen_fine_tuning_it_needs_a_context_for():
    base = ['method.name="fedavg"', "data.context_size=0", "data.validation=0.2"]
    assert load_config(None, base).data.validation_mode == "replace"  # unseen clients are not evaluated
    with pytest.raises(ValueError, match="context_size"):  # beside the test split they are, so they need one
        load_config(None, [*base, 'data.validation_mode="alongside"'])
    with pytest.raises(ValueError, match="validation_mode"):
        load_config(None, ['data.validation_mode="both"'])
