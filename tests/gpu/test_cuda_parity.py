"""fxamp O1 with the torch-cuda preset gives the dtypes torch.autocast gives on CUDA (fp16), for
every entry of torch's CUDA autocast lists (tests/autocast_lists.py). Skips without CUDA."""

import pytest
import torch
from autocast_lists import cases, check, torch_lists

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA_CASES = cases(torch_lists("cuda")) if torch.cuda.is_available() else []


@pytest.mark.parametrize("list_name,op_name,args,kwargs", CUDA_CASES)
def test_cuda_autocast_parity(list_name, op_name, args, kwargs):
    check("cuda", "torch-cuda", list_name, op_name, args, kwargs, torch.float16)
