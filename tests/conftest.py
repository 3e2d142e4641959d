import os

import pytest
import torch

import treeflash_hf  # noqa: F401  (registers the Auto classes and the generate() hook)
from treeflash_hf.recipes.testing import matching_drafter, random_target


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(int(os.environ.get("TREEFLASH_TEST_THREADS", "2")))  # 1 beside another job on 2 cores


@pytest.fixture(scope="session")
def qwen3_pair():
    target = random_target("qwen3", seed=0)
    drafter = matching_drafter(target, seed=1)
    return target, drafter


def randomise_ar_layer(drafter, std: float = 0.05, seed: int = 3):
    """Give a fresh drafter a non-zero AR layer so that treeflash tables differ from the marginals."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = drafter.ar_approximation.d.weight
        weight.copy_(torch.randn(weight.shape, generator=generator) * std)
    return drafter
