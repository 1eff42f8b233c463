"""Which MPI is under mpi4py, as the run file and ``hpcps check`` record it; the launcher's environment
kept apart from the user's MPI settings; the Open MPI settings hpcps adds before MPI starts."""

import h5py
import pytest

from hpcps.cluster.launcher import clean_environ, library_name, mpi_family, open_mpi_defaults

OPEN_MPI = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, "
            "repo rev: v5.0.11rc1, Sep 16, 2026\x00")
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\nMPICH ABI:  18:2:6\n"
INTEL = "Intel(R) MPI Library 2021.19 for Linux* OS\n\x00"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO : Sun Feb 26 2024"


@pytest.mark.parametrize("text, first, name", [
    (OPEN_MPI, OPEN_MPI[:-1], "openmpi"),
    (MPICH, "MPICH Version: 5.0.2", "mpich"),
    (INTEL, "Intel(R) MPI Library 2021.19 for Linux* OS", "intel-mpi"),
    (CRAY, "MPI VERSION : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "cray-mpich"),
    ("", "unknown MPI", "other"),
])
def test_the_library_is_named_on_one_printable_line(text, first, name):
    assert library_name(text) == first
    assert mpi_family(text) == name


@pytest.mark.parametrize("text, name", [
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/", "openmpi"),
    ("HYDRA build details:\n    Version:  5.0.2\n", "mpich"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626\n", "intel-mpi"),
    ("usage: something else", "other"),
])
def test_a_launchers_version_names_its_family(text, name):
    assert mpi_family(text) == name


def test_open_mpis_version_string_fits_an_hdf5_attribute(tmp_path):
    """Open MPI ends its version in a NUL, which HDF5's variable-length strings refuse."""
    with h5py.File(tmp_path / "f.h5", "w") as f:
        with pytest.raises(ValueError, match="NUL"):
            f.attrs["raw"] = OPEN_MPI
        f.attrs["mpi_library"] = library_name(OPEN_MPI)
        assert f.attrs["mpi_library"].startswith("Open MPI v5.0.11")


def test_a_new_job_gets_the_users_mpi_settings_but_not_the_launchers(monkeypatch):
    job = {"OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "PRTE_LAUNCHED": "1",
           "OMPI_MCA_initial_wdir": "/old", "OMPI_MCA_num_procs": "5", "PMI_RANK": "1", "SLURM_PROCID": "1"}
    user = {"OMPI_MCA_btl_tcp_if_include": "eth0", "OMPI_MCA_osc": "^ucx", "PRTE_MCA_rmaps_default_mapping_policy":
            ":oversubscribe", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for name, value in {**job, **user}.items():
        monkeypatch.setenv(name, value)
    env = clean_environ(EXTRA="x")
    assert not set(job) & set(env)
    assert {k: env[k] for k in user} == user and env["EXTRA"] == "x"


EAGER = {"OMPI_MCA_btl_tcp_eager_limit": "1048576", "OMPI_MCA_btl_tcp_rndv_eager_limit": "1048576",
         "OMPI_MCA_btl_tcp_max_send_size": "1048576"}


@pytest.mark.parametrize("environ, devices, added", [
    ({"OMPI_COMM_WORLD_SIZE": "5"}, [], {"OMPI_MCA_osc": "^ucx", **EAGER}),  # Open MPI, no RDMA device
    ({"OMPI_COMM_WORLD_SIZE": "5"}, None, {"OMPI_MCA_osc": "^ucx", **EAGER}),  # no /sys/class/infiniband at all
    ({"OMPI_COMM_WORLD_SIZE": "5"}, ["mlx5_0"], EAGER),                      # InfiniBand: osc/ucx is the one
    ({"OMPI_COMM_WORLD_SIZE": "5", "OMPI_MCA_osc": "ucx"}, [], EAGER),       # the user's choice stands
    ({"OMPI_COMM_WORLD_SIZE": "5", "OMPI_MCA_btl_tcp_eager_limit": "4096"}, ["mlx5_0"],  # and so does this one
     {k: v for k, v in EAGER.items() if k != "OMPI_MCA_btl_tcp_eager_limit"}),
    ({"PMI_SIZE": "5"}, [], {}),                                             # MPICH's launcher
    ({}, [], {}),                                                            # no launcher
])
def test_open_mpis_defaults_are_added_only_where_the_user_set_none_and_ucx_windows_only_left_out_without_rdma(
        tmp_path, environ, devices, added):
    folder = tmp_path / "infiniband"
    if devices is not None:
        folder.mkdir()
        for name in devices:
            (folder / name).mkdir()
    before = dict(environ)
    assert open_mpi_defaults(environ, str(folder)) == added
    assert environ == {**before, **added}
