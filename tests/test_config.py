"""Launch input: defaults from the hardware, and bad input refused before anything starts."""

import os

import pytest

from ddp_helpers.default_job import Hardware
from ddp_helpers.errors import LaunchError
from ddp_helpers.launch_options import make_launch_config

TWO_GPUS = Hardware(("H200", "H200"))
NO_GPU = Hardware(())


@pytest.fixture
def script(write_script):
    return write_script("train", "print('hi')\n")


def test_without_gpus_the_default_is_two_gloo_cpu_ranks(script):
    config = make_launch_config(script, hardware=NO_GPU)
    assert (config.ranks_per_agent, config.backend) == (2, "gloo")
    assert "CUDA_VISIBLE_DEVICES" not in config.extra_env


def test_with_gpus_the_default_is_one_nccl_rank_per_gpu(script):
    config = make_launch_config(script, hardware=TWO_GPUS)
    assert (config.ranks_per_agent, config.backend) == (2, "nccl")


def test_gloo_on_a_gpu_machine_hides_the_gpus_from_the_ranks(script):
    config = make_launch_config(script, nproc=4, backend="gloo", hardware=TWO_GPUS)
    assert config.ranks_per_agent == 4
    assert config.extra_env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("nproc", [0, -1, "abc", "0", "", "2.5"])
def test_bad_nproc_is_refused_with_an_example(script, nproc):
    with pytest.raises(LaunchError, match=r"nproc must be .*Example: --nproc 2"):
        make_launch_config(script, nproc=nproc, hardware=NO_GPU)


def test_nproc_given_as_text_is_accepted(script):
    assert make_launch_config(script, nproc=" 3 ", hardware=NO_GPU).ranks_per_agent == 3


def test_more_nccl_ranks_than_gpus_names_the_cpu_option(script):
    with pytest.raises(LaunchError, match=r"4 ranks asked for but only 2 GPU\(s\).*backend='gloo'"):
        make_launch_config(script, nproc=4, backend="nccl", hardware=TWO_GPUS)


def test_nccl_without_gpus_names_the_cpu_option(script):
    with pytest.raises(LaunchError, match=r"needs CUDA GPUs.*backend='gloo'"):
        make_launch_config(script, backend="nccl", hardware=NO_GPU)


def test_missing_script_is_named(tmp_path):
    with pytest.raises(LaunchError, match=r"Script not found: .*nowhere\.py"):
        make_launch_config(tmp_path / "nowhere.py", hardware=NO_GPU)


def test_unknown_backend_lists_the_choices(script):
    with pytest.raises(LaunchError, match=r"'mpi'.*'nccl'.*'gloo'"):
        make_launch_config(script, backend="mpi", hardware=NO_GPU)


@pytest.mark.parametrize("timeout", [0, -5])
def test_timeout_must_be_positive(script, timeout):
    with pytest.raises(LaunchError, match="timeout must be a positive"):
        make_launch_config(script, timeout_s=timeout, hardware=NO_GPU)


def test_config_is_frozen_including_its_environment(script):
    config = make_launch_config(script, extra_env={"A": "1"}, hardware=NO_GPU)
    with pytest.raises(AttributeError):
        config.ranks_per_agent = 8
    with pytest.raises(TypeError):
        config.extra_env["A"] = "2"


@pytest.mark.parametrize("timeout", ["10", True, float("nan"), float("inf")])
def test_timeout_must_be_a_number_of_seconds(script, timeout):
    with pytest.raises(LaunchError, match="timeout must be"):
        make_launch_config(script, timeout_s=timeout, hardware=NO_GPU)


def test_more_cpu_ranks_than_the_machine_can_run_are_refused(script):
    with pytest.raises(LaunchError, match=r"nproc 100000 is more processes than this machine can run"):
        make_launch_config(script, nproc=100000, hardware=NO_GPU)


@pytest.mark.parametrize(
    "extra_env, message",
    [
        ({"SEED": 3}, r"extra_env\['SEED'\] must be a string, got int 3: write it as '3'"),
        ({"A B": "1"}, r"not an environment variable name"),
        ({"DDP_HELPERS_RUN_ID": "x"}, r"may not set DDP_HELPERS_RUN_ID"),
        ({"MASTER_PORT": "29500"}, r"may not set MASTER_PORT"),
        ({"TORCHELASTIC_RUN_ID": "x"}, r"may not set TORCHELASTIC_RUN_ID"),
        (["A=1"], r"extra_env must be a dict"),
    ],
)
def test_bad_extra_env_is_refused_naming_the_entry(script, extra_env, message):
    with pytest.raises(LaunchError, match=message):
        make_launch_config(script, extra_env=extra_env, hardware=NO_GPU)


def test_a_cwd_that_is_not_a_folder_is_refused(script, tmp_path):
    with pytest.raises(LaunchError, match="is not a folder"):
        make_launch_config(script, cwd=tmp_path / "nowhere", hardware=NO_GPU)
    assert make_launch_config(script, cwd=tmp_path, hardware=NO_GPU).working_dir == tmp_path.resolve()


ONE_GPU = Hardware(("H200",))


def test_one_gpu_is_no_world_so_the_default_is_two_cpu_ranks(script):
    config = make_launch_config(script, hardware=ONE_GPU)
    assert (config.ranks_per_agent, config.backend) == (2, "gloo")
    assert config.extra_env["CUDA_VISIBLE_DEVICES"] == ""
    assert (make_launch_config(script, nproc=1, backend="nccl", hardware=ONE_GPU).backend) == "nccl"


def test_more_ranks_than_gpus_without_a_backend_run_on_the_cpu(script):
    assert make_launch_config(script, nproc=2, hardware=TWO_GPUS).backend == "nccl"
    config = make_launch_config(script, nproc=3, hardware=TWO_GPUS)
    assert (config.ranks_per_agent, config.backend) == (3, "gloo")


@pytest.mark.parametrize("nnodes", [0, -1, "two", 1.5, True, 9])
def test_bad_nnodes_is_refused_with_an_example(script, nnodes):
    with pytest.raises(LaunchError, match=r"nnodes must be a whole number of agents from 1 to 8.*Example: --nnodes 2"):
        make_launch_config(script, nnodes=nnodes, hardware=NO_GPU)


def test_nnodes_multiplies_the_world_and_is_checked_against_the_gpus(script):
    config = make_launch_config(script, nproc=2, nnodes="3", hardware=NO_GPU)
    assert (config.nnodes, config.world_size) == (3, 6)
    with pytest.raises(LaunchError, match=r"4 ranks asked for but only 2 GPU\(s\).*nproc x nnodes <= 2"):
        make_launch_config(script, nproc=2, nnodes=2, backend="nccl", hardware=TWO_GPUS)


@pytest.mark.parametrize("kill_rank, kill_after, message", [
    (1, None, "kill_rank and kill_after go together"),
    (None, "step 3", "kill_rank and kill_after go together"),
    (2, "step 3", r"kill_rank must be a rank of this run, 0 to 1, got 2"),
    ("one", "step 3", r"kill_rank must be a rank of this run"),
    (1, "", "kill_after must be a non-empty line"),
    (1, "two\nlines", "kill_after must be a non-empty line"),
])
def test_bad_kill_options_are_refused(script, kill_rank, kill_after, message):
    with pytest.raises(LaunchError, match=message):
        make_launch_config(script, nproc=2, kill_rank=kill_rank, kill_after=kill_after, hardware=NO_GPU)


@pytest.mark.parametrize("nnodes, join_after, message", [
    (1, "step 3", "join_after needs agents to join: nnodes 2 or more"),
    (2, " ", "join_after must be a non-empty line"),
])
def test_bad_join_options_are_refused(script, nnodes, join_after, message):
    with pytest.raises(LaunchError, match=message):
        make_launch_config(script, nproc=2, nnodes=nnodes, join_after=join_after, hardware=NO_GPU)


def test_a_slurm_launch_takes_its_defaults_from_the_job_not_this_machine(script):
    from ddp_helpers.engines.slurm import SlurmJob

    cpu = make_launch_config(script, job=SlurmJob(nodes=3), hardware=TWO_GPUS)
    assert (cpu.ranks_per_agent, cpu.backend, cpu.nnodes, cpu.world_size) == (2, "gloo", 3, 6)
    gpu = make_launch_config(script, job=SlurmJob(nodes=2, gpus_per_node=8), hardware=NO_GPU)
    assert (gpu.ranks_per_agent, gpu.backend, gpu.world_size) == (8, "nccl", 16)


@pytest.mark.parametrize("job, options, message", [
    ({"nodes": 0}, {}, "slurm nodes must be a whole number from 1 to 64"),
    ({"partition": "a b"}, {}, "slurm partition 'a b' is not a valid value"),
    ({"sbatch_args": "--mem=4G"}, {}, "sbatch_args must be sbatch options, each as one string"),
    ({"gpus_per_node": 2}, {"nproc": 4}, "4 ranks per node but 2 GPU"),
    ({}, {"backend": "nccl"}, "backend 'nccl' on Slurm needs GPUs"),
    ({}, {"nnodes": 2}, "nnodes is for runs on this machine"),
])
def test_bad_slurm_jobs_are_refused_before_submitting(script, job, options, message):
    from ddp_helpers.engines.slurm import SlurmJob

    with pytest.raises(LaunchError, match=message):
        make_launch_config(script, job=SlurmJob(**job), hardware=NO_GPU, **options)


def test_nnodes_1_is_the_default_and_goes_with_slurm(script):
    from ddp_helpers.engines.slurm import SlurmJob

    config = make_launch_config(script, nnodes="1", job=SlurmJob(nodes=2), hardware=NO_GPU)
    assert config.nnodes == 2  # the job's nodes
    with pytest.raises(LaunchError, match="nnodes is for runs on this machine"):
        make_launch_config(script, nnodes="2", job=SlurmJob(nodes=2), hardware=NO_GPU)


def test_a_record_name_too_long_for_a_file_is_one_clear_error():
    from ddp_helpers import record

    with pytest.raises(ValueError, match="record name must be 1 to 200 letters"):
        record("x" * 300, 1)
    assert record("x" * 200, 1) == 1  # outside a launch: nothing stored


def test_slurm_refused_on_a_machine_outside_any_cluster_says_so(tmp_path, monkeypatch):
    """Slurm's commands installed but no cluster (a laptop with the Debian packages): sbatch's own DNS errors,
    then what they mean and what to do."""
    from ddp_helpers.engines.slurm import submit

    for command, output in (("sbatch", "sbatch: fatal: Could not establish a configuration source"),
                            ("sinfo", "sinfo: fatal: Could not establish a configuration source")):
        fake = tmp_path / command
        fake.write_text(f"#!/bin/sh\necho '{output}' >&2\nexit 1\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(LaunchError, match=r"(?s)configuration source\nNo Slurm controller answers from this machine.*"
                                          r"drop --slurm to run here"):
        submit(tmp_path / "job.sbatch")
