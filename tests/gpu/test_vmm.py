"""Device memory released and taken back at the same addresses (rlx.utils.vmm): on CUDA only."""

from __future__ import annotations

import pytest
import torch

from rlx.utils import vmm


def test_not_offered_off_cuda():
    assert not vmm.supported(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_release_and_restore_keep_the_addresses_and_free_the_memory():
    cuda = torch.device("cuda")
    assert vmm.supported(cuda)
    shapes = [((1000, 3), torch.float32), ((7,), torch.bfloat16), ((64 << 20,), torch.uint8)]
    buffer, (a, b, c) = vmm.carve(shapes, cuda)
    assert [t.shape for t in (a, b, c)] == [torch.Size(s) for s, _ in shapes] and a.is_cuda
    assert all(t.data_ptr() % vmm.ALIGN == 0 for t in (a, b, c)) and b.data_ptr() >= a.data_ptr() + a.nbytes
    assert len({t.untyped_storage().data_ptr() for t in (a, b, c)}) == 3  # no aliasing for torch.compile to see
    a.fill_(2.5)
    c.fill_(7)
    assert a.sum().item() == 7500 and int(c[-1]) == 7
    graph = torch.cuda.CUDAGraph()  # a graph captured on the buffer works after the memory was replaced
    with torch.cuda.graph(graph):
        a.mul_(2)
    pointers = [t.data_ptr() for t in (a, b, c)]
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    assert buffer.release() == buffer.nbytes and not buffer.mapped
    assert torch.cuda.mem_get_info()[0] - free >= buffer.nbytes
    assert buffer.release() == 0  # already released
    buffer.restore()
    buffer.zero_()
    assert buffer.mapped and [t.data_ptr() for t in (a, b, c)] == pointers
    a.fill_(1.0)
    graph.replay()
    assert a.sum().item() == 6000 and int(c.sum()) == 0
    del a, b, c, graph
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    del buffer  # the last reference: the memory and the addresses are freed
    assert torch.cuda.mem_get_info()[0] - free >= 64 << 20
