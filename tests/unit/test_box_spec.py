"""The cluster in a box, described (hpcps.box.spec): parsing, the commands that build it, the launch line."""

import json

import pytest

from hpcps.box import cluster_record, node_label
from hpcps.box.spec import (NODE_IFACE, Cluster, Node, box_pid, burst_bytes, describe_record, make_cluster,
                            mpi_environment, mpmd_argv, parse_rate, parse_size, setup_commands, ssh_agent_script)


@pytest.mark.parametrize("text,bps", [("1gbit", 10 ** 9), ("250mbit", 250 * 10 ** 6), ("100kbit", 10 ** 5),
                                      ("2.5Gbit", 25 * 10 ** 8), ("8000", 8000)])
def test_rates_are_bits_per_second_with_si_prefixes(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text,nbytes", [("64kb", 64000), ("64kib", 65536), ("1mib", 1 << 20), ("1500", 1500)])
def test_sizes_are_bytes(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("bad", ["fast", "1gbps", "-1gbit", "0mbit", ""])
def test_a_bad_rate_names_what_is_expected(bad):
    with pytest.raises(ValueError, match="link rate such as 1gbit"):
        parse_rate(bad)


def test_links_apply_to_every_node_then_to_named_nodes_and_ranges():
    c = make_cluster(5, ["1gbit", "0=4gbit", "3-4=250mbit"], buffer="64kb")
    assert [n.rate_bps for n in c.nodes] == [4 * 10 ** 9, 10 ** 9, 10 ** 9, 250 * 10 ** 6, 250 * 10 ** 6]
    assert c.buffer_bytes == 64000 and c.n_ranks == 5


def test_ranks_per_node_and_overrides_give_the_rank_to_node_map():
    c = make_cluster(3, [], buffer="1mb", ranks_per_node=2, ranks=["0=1", "2=3"])
    assert [n.ranks for n in c.nodes] == [1, 2, 3]
    assert c.node_of_rank() == [0, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(nodes=0, links=[]), "--nodes must be 1 to 250"),
    (dict(nodes=2, links=["5=1gbit"]), r"--link '5=1gbit': nodes are 0 to 1"),
    (dict(nodes=2, links=["a=1gbit"]), "expected NODE=VALUE"),
    (dict(nodes=2, links=["1=fast"]), "--link: 'fast' is not a link rate"),
    (dict(nodes=2, links=[], ranks=["0"]), "--ranks '0': expected NODE=COUNT"),
    (dict(nodes=2, links=[], ranks_per_node=0), "runs no rank"),
])
def test_bad_cluster_words_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_cluster(buffer="64kb", **kwargs)


def test_every_name_carries_the_prefix_and_nothing_touches_the_host_namespace():
    c = make_cluster(3, ["1gbit"], buffer="64kb", prefix="hpcps4242-")
    cmds = setup_commands(c)
    namespaces = {"hpcps4242-sw", "hpcps4242-n0", "hpcps4242-n1", "hpcps4242-n2"}
    for argv in cmds:
        if argv[:3] == ["ip", "netns", "add"]:
            assert argv[3] in namespaces
        else:  # every other command runs inside one of the box's namespaces (ip -n NS / tc -n NS)
            assert argv[1] == "-n" and argv[2] in namespaces, argv
    assert box_pid("hpcps4242-n1") == 4242 and box_pid("other-ns") is None


def test_both_directions_of_each_link_are_shaped_and_the_switch_queue_is_the_buffer():
    c = make_cluster(2, ["1gbit", "1=250mbit"], buffer="64kb", prefix="hpcps7-")
    tbf = [argv for argv in setup_commands(c) if argv[0] == "tc"]
    assert len(tbf) == 4
    by_dev = {(argv[2], argv[argv.index("dev") + 1]): argv for argv in tbf}
    node1_up, node1_down = by_dev["hpcps7-n1", NODE_IFACE], by_dev["hpcps7-sw", "p1"]
    for argv in (node1_up, node1_down):
        assert argv[argv.index("rate") + 1] == "250000000bit"
        assert int(argv[argv.index("burst") + 1]) == burst_bytes(250 * 10 ** 6)
    assert int(node1_down[node1_down.index("limit") + 1]) == max(64000, burst_bytes(250 * 10 ** 6))


def test_the_nodes_tcp_runs_the_named_congestion_control_on_their_subnets_route():
    """Every connection between two nodes follows the subnet's route, so its ``congctl`` is what they run:
    cubic unless told otherwise, whatever the host's default; ``host`` leaves the route as the kernel made
    it. The record (the run file's ``cluster``) and the box's line name it."""
    def routes(cluster):
        return [argv for argv in setup_commands(cluster) if argv[3:5] == ["route", "replace"]]

    c = make_cluster(2, [], buffer="64kb", prefix="hpcps7-")
    assert c.congestion == "cubic"
    assert routes(c) == [["ip", "-n", f"hpcps7-n{k}", "route", "replace", "10.213.0.0/24", "dev", NODE_IFACE,
                          "proto", "kernel", "scope", "link", "src", f"10.213.0.{k + 1}", "congctl", "cubic"]
                         for k in range(2)]
    commands = setup_commands(c)  # after the address that made the kernel's route, before any rank starts
    assert commands.index(routes(c)[0]) > commands.index(["ip", "-n", "hpcps7-n0", "addr", "add", "10.213.0.1/24",
                                                          "dev", NODE_IFACE])
    assert c.record()["congestion"] == "cubic" and describe_record(c.record()).endswith(", TCP cubic")
    assert [argv[-1] for argv in routes(make_cluster(2, [], buffer="64kb", congestion="reno"))] == ["reno"] * 2
    assert routes(make_cluster(2, [], buffer="64kb", congestion="host")) == []
    with pytest.raises(ValueError, match="--congestion 'cubic; reboot'"):
        make_cluster(2, [], buffer="64kb", congestion="cubic; reboot")
    assert "TCP" not in describe_record({k: v for k, v in c.record().items() if k != "congestion"})  # older files


def test_the_bucket_holds_a_gso_packet_and_a_millisecond():
    assert burst_bytes(10 ** 9) == 125000 and burst_bytes(10 ** 8) == 64 * 1024 + 4096


def test_the_launch_line_starts_each_nodes_ranks_in_its_namespace():
    c = make_cluster(3, [], buffer="64kb", ranks=["1=2", "2=0"], prefix="hpcps9-")
    argv = mpmd_argv(c, "mpiexec", ["hpcps", "train", "--steps", "5"])
    segments = " ".join(argv[1:]).split(" : ")
    assert segments == ["-n 1 ip netns exec hpcps9-n0 env HPCPS_NODE=0 hpcps train --steps 5",
                        "-n 2 ip netns exec hpcps9-n1 env HPCPS_NODE=1 hpcps train --steps 5"]


def test_ranks_learn_the_cluster_and_their_node_from_the_environment():
    c = make_cluster(2, ["0=4gbit"], buffer="64kb")
    env = mpi_environment(c)
    assert env["FI_TCP_IFACE"] == NODE_IFACE and env["MPIR_CVAR_NOLOCAL"] == "1"
    record = cluster_record(env)
    assert record == json.loads(json.dumps(c.record()))
    assert record["link_bps"] == [4 * 10 ** 9, 10 ** 9] and record["node_of_rank"] == [0, 1]
    assert node_label("vm", {"HPCPS_NODE": "1"}) == "vm/n1" and node_label("vm", {}) == "vm"
    assert cluster_record({}) is None


def test_a_prefix_must_be_ours():
    with pytest.raises(ValueError, match="hpcps<digits>-"):
        Cluster((Node(10 ** 9),), 1000, prefix="eth")


def test_open_mpis_launcher_runs_in_the_first_nodes_namespace_and_starts_a_daemon_on_each_node():
    """Open MPI's launcher runs in the first node's namespace under that node's host name; each segment
    names its node by address, where a daemon of its own starts through the agent script (one daemon for
    all put MPI_Win_allocate windows in the host's shared memory); point-to-point goes over the TCP BTL
    alone and one-sided through osc/rdma, the daemons and PMIx on the nodes' interface."""
    c = make_cluster(3, [], buffer="64kb", ranks=["0=0", "1=2"], prefix="hpcps9-")
    argv = mpmd_argv(c, "mpirun", ["hpcps", "train"], "openmpi")
    assert argv[:11] == ["ip", "netns", "exec", "hpcps9-n1", "unshare", "--uts", "sh", "-c",
                         'hostname "$0" && exec "$@"', "hpcps9-n1", "mpirun"]
    assert " ".join(argv[11:]).split(" : ") == ["-n 2 --host 10.213.0.2:2 env HPCPS_NODE=1 hpcps train",
                                                "-n 1 --host 10.213.0.3:1 env HPCPS_NODE=2 hpcps train"]
    ulfm = mpmd_argv(c, "mpirun", ["hpcps", "train"], "openmpi", ["--with-ft", "ulfm"])  # hpcps emulate --ulfm
    assert ulfm[:14] == argv[:11] + ["--with-ft", "ulfm", "-n"] and ulfm[13:] == argv[11:]
    env = mpi_environment(c, "openmpi", agent="/tmp/agent.sh")
    assert env["OMPI_MCA_btl"] == "self,tcp" and env["OMPI_MCA_osc"] == "rdma"
    assert env["OMPI_MCA_btl_tcp_if_include"] == env["PMIX_MCA_ptl_tcp_if_include"] == NODE_IFACE
    assert env["PRTE_MCA_plm_ssh_agent"] == "/tmp/agent.sh"
    assert "MPIR_CVAR_NOLOCAL" not in env and cluster_record(env) == json.loads(json.dumps(c.record()))


def test_the_agent_script_runs_a_daemons_command_in_its_nodes_namespace_under_its_own_host_name(tmp_path):
    """Called as ssh would be (the node's address, then the daemon's shell line), the script runs that
    line through ``ip netns exec`` in the node's namespace (a stand-in ``ip`` prints what it was given);
    an address no node has is one line on stderr and exit status 1."""
    import subprocess

    c = make_cluster(3, [], buffer="64kb", ranks=["0=0", "1=2"], prefix="hpcps9-")
    agent = tmp_path / "agent.sh"
    agent.write_text(ssh_agent_script(c))
    agent.chmod(0o755)
    (tmp_path / "ip").write_text('#!/bin/sh\nprintf "%s|" "$@"\n')
    (tmp_path / "ip").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    done = subprocess.run([str(agent), "10.213.0.3", "PATH=/x;export PATH;prted", "--flag", "a b"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("|")[:9] == ["netns", "exec", "hpcps9-n2", "unshare", "--uts", "sh", "-c",
                                          'hostname "$0" && exec sh -c "$1"', "hpcps9-n2"]
    assert done.stdout.split("|")[9] == "PATH=/x;export PATH;prted --flag a b"
    missing = subprocess.run([str(agent), "10.213.0.1", "prted"], env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and "no emulated node has the address 10.213.0.1" in missing.stderr


def test_intel_mpi_in_the_box_takes_ofi_alone_over_tcp_on_the_nodes_interface():
    """Intel MPI takes shared memory between ranks of one host whatever MPICH's variables say (a job hung
    in the box): OFI alone, over its TCP provider on the node's interface; hydra starts the segments as
    MPICH's does."""
    c = make_cluster(2, [], buffer="64kb", prefix="hpcps9-")
    env = mpi_environment(c, "intel-mpi")
    assert (env["I_MPI_FABRICS"], env["I_MPI_OFI_PROVIDER"], env["FI_TCP_IFACE"]) == ("ofi", "tcp", NODE_IFACE)
    assert "MPIR_CVAR_NOLOCAL" not in env and cluster_record(env) == json.loads(json.dumps(c.record()))
    assert mpmd_argv(c, "mpiexec", ["x"], "intel-mpi") == mpmd_argv(c, "mpiexec", ["x"], "mpich")


@pytest.mark.parametrize("family", ["mpich", "openmpi", "intel-mpi"])
def test_a_dry_runs_lines_paste_into_a_shell_as_the_commands_the_box_runs(monkeypatch, family):
    """Every line --dry-run prints splits back (as a shell reads it) into the command the box would run:
    Open MPI's launch line carries a quoted ``sh -c`` script."""
    import shlex

    from hpcps.box import launch

    c = make_cluster(2, [], buffer="64kb", prefix="hpcps9-")
    monkeypatch.setattr(launch, "find_mpiexec", lambda: "/opt/mpi/bin/mpiexec")
    monkeypatch.setattr(launch, "box_family", lambda mpiexec: family)
    lines: list[str] = []
    launch.dry_run(c, ["python", "-c", "print('a b')"], log=lines.append)
    assert shlex.split(lines[-1]) == mpmd_argv(c, "/opt/mpi/bin/mpiexec", ["python", "-c", "print('a b')"], family)
    assert [shlex.split(line) for line in lines[:len(setup_commands(c))]] == setup_commands(c)
    exports = [shlex.split(line)[1] for line in lines if line.startswith("export ")]
    assert "HPCPS_CLUSTER=" + json.dumps(c.record(), separators=(",", ":")) in exports


def test_a_dry_run_with_a_link_trace_prints_the_sampler_before_the_job(monkeypatch):
    """``--link-trace`` is not dropped by ``--dry-run``: the sampler's line, in the switch's namespace, every
    node's rate given, the file named as it will be written (``.npz``), comes before the job's."""
    import shlex

    from hpcps.box import launch

    c = make_cluster(3, ["2=100mbit"], buffer="64kb", prefix="hpcps9-")
    monkeypatch.setattr(launch, "find_mpiexec", lambda: "/opt/mpi/bin/mpiexec")
    lines: list[str] = []
    launch.dry_run(c, ["true"], log=lines.append, link_trace="/tmp/links")
    sampler = shlex.split(lines[-2], comments=True)
    assert sampler[:4] == ["ip", "netns", "exec", c.switch] and sampler[5:] == [
        "-m", "hpcps.box.trace", "sample", "--out", "/tmp/links.npz", "--rates", "1000000000", "1000000000",
        "100000000", "&"]
