"""Lesson 4's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Machine 1 of a job runs 4 workers per machine. What is the RANK of its worker with LOCAL_RANK 2?",
             ("2", "6", "9"), 1, "RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK = 1 x 4 + 2 = 6.",
             "Look at the formula in the two-machine section."),
    Question("Which GPU should a worker use on its machine?",
             ("cuda:RANK", "cuda:LOCAL_RANK", "cuda:GROUP_RANK"), 1,
             "RANK counts workers across machines; each machine's GPUs are numbered from 0, like LOCAL_RANK.",
             "On machine 1, RANK 6 does not exist as a GPU index."),
    Question("With --max-restarts 1, one worker is killed. What happens?",
             ("Only that worker restarts and continues", "Every worker is stopped and restarted from the top of the script",
              "The job ends"), 1,
             "torchrun restarts the whole worker group; the script must resume from its snapshot.",
             "Look at where the second attempt of rank 0 began."),
    Question("A snapshot saves each rank's torch.get_rng_state() and the resume restores it. After a restart, which "
             "randomness still differs from a run without one?",
             ("Dropout masks", "Noise drawn with torch.randn(..., generator=g), g a torch.Generator the script made",
              "Nothing: every torch random number comes from that state"), 1,
             "torch.get_rng_state() is the global CPU generator's state, which dropout and torch.randn without a generator "
             "draw from. A Generator the script made has a state of its own (g.get_state()): save and restore it too, "
             "per rank, as every generator a step draws from (CUDA's, numpy's, Python's random).",
             "Which generator does each line draw from?"),
    Question("Why --rdzv-id $SLURM_JOB_ID?",
             ("It sets the master port", "It keeps two jobs' agents from joining each other", "It is required by srun"), 1,
             "Agents meet by endpoint and id: a unique id per job means one job's agents never join another's.",
             "What if two jobs used the same endpoint?"),
    Question("Machine 1 of a new two-machine job prints 'The client socket has timed out ... trying to connect to "
             "(10.1.2.9, 29400)', and machine 0 says '1/2 clients joined'. What do you check first?",
             ("The GPUs' drivers on machine 1", "NCCL_DEBUG=INFO from the training",
              "The head address machine 1 was given, and how it reaches it: ip route get 10.1.2.9"), 2,
             "No worker has started yet: the agents never met. Either the address is wrong, or this machine reaches it "
             "through another interface; ip route get names the interface and this machine's address on it.",
             "Had any line of the training run yet?"),
]
