import pytest
import torch

from fedtailor.models import FlatLayout, build_model, get_flat, num_parameters, set_flat


@pytest.mark.parametrize(("shape", "expected"), [((1, 28, 28), 85_822), ((3, 32, 32), 121_182)])
def test_lenet_has_the_papers_parameter_count(shape, expected):
    model = build_model("lenet", input_shape=shape, num_classes=10)
    assert num_parameters(model) == expected
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_public_seed_fixes_the_initialisation():
    a = get_flat(build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=41))
    b = get_flat(build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=41))
    c = get_flat(build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=42))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_flat_round_trip_and_layout_order():
    model = build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=0)
    layout = FlatLayout.of(model)
    vec = torch.randn(layout.size)
    set_flat(model, vec)
    assert torch.equal(get_flat(model), vec)
    parts = layout.unflatten(vec)
    assert list(parts) == [n for n, _ in model.named_parameters()]
    assert torch.equal(layout.flatten(parts), vec)
    batched = layout.unflatten(torch.stack([vec, 2 * vec]))
    assert torch.equal(batched["fc3.bias"][1], 2 * parts["fc3.bias"])


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="lenet"):
        build_model("resnet", input_shape=(1, 28, 28), num_classes=10)
