import pytest
import torch

from lightning_hpc.models import alexnet_one_tower, build_model, cifar_resnet, resnet, small_cnn

REFERENCE_PARAMS = {18: 11_689_512, 34: 21_797_672, 50: 25_557_032, 101: 44_549_160, 152: 60_192_808}


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("depth", sorted(REFERENCE_PARAMS))
def test_imagenet_resnet_parameter_counts_match_reference(depth):
    with torch.device("meta"):
        model = resnet(depth, num_classes=1000)
    assert n_params(model) == REFERENCE_PARAMS[depth]


@pytest.mark.parametrize(
    "depth,expected", [(20, 269_722), (32, 464_154), (44, 658_586), (56, 853_018), (110, 1_727_962)]
)
def test_cifar_resnet_parameter_counts(depth, expected):
    # He et al. (2016) Table 6: 0.27M, 0.46M, 0.66M, 0.85M, 1.7M (option-A shortcuts carry no parameters)
    assert n_params(cifar_resnet(depth)) == expected


def test_cifar_resnet_shapes_and_bad_depth():
    assert cifar_resnet(20)(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="6n\\+2"):
        cifar_resnet(33)
    with pytest.raises(ValueError, match="must be one of"):
        resnet(42)


def test_resnet18_forward_shape_small_input():
    assert resnet(18, num_classes=7)(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_alexnet_one_tower_layout():
    model = alexnet_one_tower()
    convs = [m.out_channels for m in model.features if isinstance(m, torch.nn.Conv2d)]
    fcs = [m.out_features for m in model.classifier if isinstance(m, torch.nn.Linear)]
    assert convs == [64, 192, 384, 384, 256]
    assert fcs == [4096, 4096, 1000]
    head = sum(p.numel() for p in model.classifier.parameters())
    assert head / n_params(model) > 0.94  # the paper: the FC layers hold ~95% of the parameters
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_build_model_by_name():
    with torch.device("meta"):
        assert n_params(build_model("resnet50")) == REFERENCE_PARAMS[50]
    assert isinstance(build_model("small_cnn"), torch.nn.Sequential)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg16")


def test_small_cnn_digits_shape():
    assert small_cnn(1, 10)(torch.randn(4, 1, 8, 8)).shape == (4, 10)


@pytest.mark.parametrize("name,params", [("efficientnet", 5_288_548), ("mobilenetv3", 2_542_856)])
def test_modern_cnns_have_the_reference_parameter_counts(name, params):
    """EfficientNet-B0 and MobileNetV3-Small at 1000 classes: the parameter counts of the reference
    implementations (torchvision's efficientnet_b0 and mobilenet_v3_small), so widths, depths, SE sizes and heads
    are the papers'."""
    assert sum(p.numel() for p in build_model(name, num_classes=1000).parameters()) == params


def test_convnext_atto_shapes_and_size():
    m = build_model("convnext", num_classes=1000)
    assert abs(sum(p.numel() for p in m.parameters()) - 3.7e6) < 0.01 * 3.7e6  # ConvNeXt-atto: 3.7M parameters
    assert m(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
