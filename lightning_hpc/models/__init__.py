"""Plain ``nn.Module`` models: they never import strategies (a strategy adapts the model)."""

from collections.abc import Callable

from torch import nn

from lightning_hpc.models.alexnet import AlexNetOneTower, alexnet_one_tower
from lightning_hpc.models.mesh_fcn import MeshFCN, mesh_fcn
from lightning_hpc.models.modern_cnns import convnext, efficientnet, mobilenetv3
from lightning_hpc.models.ode_resnet import (
    ODEResNet,
    ResidualStep,
    ode_resnet,
    paper_inference_net,
)
from lightning_hpc.models.resnet import (
    CifarResNet,
    ResNet,
    cifar_resnet,
    resnet,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
)
from lightning_hpc.models.small_cnn import small_cnn
from lightning_hpc.models.unet import UNet, unet

__all__ = [
    "AlexNetOneTower",
    "MeshFCN",
    "mesh_fcn",
    "alexnet_one_tower",
    "CifarResNet",
    "ResNet",
    "cifar_resnet",
    "resnet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "small_cnn",
    "UNet",
    "unet",
    "ODEResNet",
    "ResidualStep",
    "ode_resnet",
    "paper_inference_net",
    "convnext",
    "efficientnet",
    "mobilenetv3",
    "build_model",
]


def build_model(name: str, **kwargs):
    """Build a model of the zoo by name: ``resnet50``, ``cifar_resnet32``, ``alexnet``, ``small_cnn``, ``convnext``,
    ``efficientnet``, ``mobilenetv3``, ..."""
    if name.startswith("resnet") and name[6:].isdigit():
        return resnet(int(name[6:]), **kwargs)
    if name.startswith("cifar_resnet") and name[12:].isdigit():
        return cifar_resnet(int(name[12:]), **kwargs)
    if name in ("alexnet", "alexnet_one_tower"):
        return alexnet_one_tower(**kwargs)
    if name == "mesh_fcn":
        return mesh_fcn(**kwargs)
    if name == "small_cnn":
        return small_cnn(**kwargs)
    if name == "ode_resnet":
        return ode_resnet(**kwargs)
    if name == "unet":
        return unet(**kwargs)
    if name in _MODERN:
        return _MODERN[name](**kwargs)
    raise ValueError(
        f"unknown model {name!r}; known: resnet18..152, cifar_resnet20..110, alexnet, mesh_fcn, small_cnn, ode_resnet, "
        "unet, convnext, efficientnet, mobilenetv3"
    )


_MODERN: dict[str, Callable[..., nn.Module]] = {"convnext": convnext, "efficientnet": efficientnet,
                                               "mobilenetv3": mobilenetv3}
