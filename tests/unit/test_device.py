"""Device choice and CUDA-awareness detection (hpcps.cluster.device), and the MPI library's own answer."""

import pytest
import torch

from hpcps.cluster.device import CudaAwareness, choose_cuda_aware, detect_cuda_aware, plan_device, select_device
from hpcps.errors import UserError

OPEN_MPI = "Open MPI v4.1.5, package: Open MPI builder Distribution, ident: 4.1.5, repo rev: v4.1.5, Feb 23, 2023"
MPICH = "MPICH Version:      4.2.1\nMPICH Release date: Thu Apr 11 2024\nMPICH configure:    --with-device=ch4:ofi"
MPICH_CUDA = MPICH + " --with-cuda=/usr/local/cuda"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.15 (ANL base 3.4a2)\nMPI BUILD INFO : Wed Nov 15 2023"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"


@pytest.mark.parametrize("requested, local, n_gpus, expected", [
    ("auto", 0, 4, "cuda:0"), ("auto", 3, 4, "cuda:3"),
    ("auto", 5, 4, "cuda:1"),  # more workers on the node than GPUs: they share, round robin
    ("auto", 2, 1, "cuda:0"),  # a rank bound to one GPU sees it as cuda:0
    ("auto", 1, 0, "cpu"), ("cpu", 1, 4, "cpu"), ("cuda", 1, 2, "cuda:1"),
    ("auto", None, 4, "cpu"), ("cuda", None, 4, "cpu"),  # servers never take a GPU
])
def test_workers_take_the_gpu_of_their_index_on_the_node(requested, local, n_gpus, expected):
    assert select_device(requested, local, n_gpus) == torch.device(expected)


def test_device_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(UserError, match=r"--device cuda: this rank sees no CUDA device"):
        select_device("cuda", 0, 0)


@pytest.mark.parametrize("version, env, query, aware", [
    (OPEN_MPI, {}, True, True), (OPEN_MPI, {}, False, False),
    (OPEN_MPI, {"OMPI_MCA_opal_cuda_support": "false"}, True, False),  # switched off at run time wins
    (OPEN_MPI, {}, None, False),  # cannot tell: stage
    (MPICH, {}, False, False), (MPICH_CUDA, {}, True, True),
    (MPICH_CUDA, {}, None, True),  # an MPICH older than 4.0: its configure line says it
    (MPICH_CUDA, {"MPIR_CVAR_ENABLE_GPU": "0"}, None, False),
    (CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, None, True), (CRAY, {}, None, False),
    (CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, True, False),
    (MVAPICH, {"MV2_USE_CUDA": "1"}, None, True), (MVAPICH, {"MV2_USE_CUDA": "0"}, None, False),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", {}, None, False), ("", {}, None, False),
])
def test_cuda_awareness_from_version_vendor_variables_and_query(version, env, query, aware):
    found = detect_cuda_aware(version, env, query)
    assert found.aware is aware and found.reason


def test_the_reason_names_what_decided():
    assert detect_cuda_aware(CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, None).reason == \
        "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1"
    assert detect_cuda_aware(MPICH, {}, False).reason == "MPIX_Query_cuda_support() of MPICH Version: 4.2.1 returned 0"


def test_cuda_aware_yes_and_no_override_detection():
    def detect():
        raise AssertionError("detection must not run when the user decided")
    assert choose_cuda_aware("yes", detect) == CudaAwareness(True, "--cuda-aware yes")
    assert choose_cuda_aware("no", detect) == CudaAwareness(False, "--cuda-aware no")
    assert choose_cuda_aware("auto", lambda: CudaAwareness(True, "probe")).aware


def test_plan_device_picks_the_transfer_mode():
    aware, unaware = (lambda: CudaAwareness(True, "probe")), (lambda: CudaAwareness(False, "probe"))
    assert plan_device("auto", "auto", 1, 2, aware).transfer == "direct"
    assert plan_device("auto", "auto", 1, 2, unaware).transfer == "staged"
    assert plan_device("auto", "no", 1, 2, aware).transfer == "staged"
    cpu = plan_device("auto", "yes", 1, 0, aware)  # no GPU: --cuda-aware has nothing to decide
    assert (cpu.device, cpu.transfer) == (torch.device("cpu"), "shared")
    assert plan_device("cuda", "auto", 0, 1, unaware).describe() == \
        "cuda:0, staged through pinned host memory (probe)"


def test_the_mpi_library_answers_the_cuda_query_as_its_build_says():
    from mpi4py import MPI

    from hpcps.transport.mpilib import query_cuda_support

    version = MPI.Get_library_version()
    if not version.startswith("MPICH Version:") or int(version.split()[2].split(".")[0]) < 4:
        pytest.skip("MPIX_Query_cuda_support is checked against MPICH >= 4 (the CI's MPI)")
    assert query_cuda_support() is ("--with-cuda" in version)
