"""Deep dive 5b's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("A 64-GPU job's log says: [Rank 12] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4810, "
             "OpType=ALLREDUCE, ...). What does it tell you?",
             ("Rank 12 is the rank that caused the hang",
              "Rank 12 waited in one all-reduce past the group's timeout; which rank never came is in the ranks' "
              "flight-recorder dumps", "NCCL crashed on rank 12"), 1,
             "Every rank that waits logs its own line. The rank that never called the collective logs nothing of "
             "it: compare the ranks' dumps (torchfrtrace) to find it.",
             "Which ranks print this message: those that wait, or the one that is missing?"),
    Question("Rank 1 raised ValueError, and rank 0 failed with 'Connection closed by peer' in the same second. With "
             "@record on main, torchrun's summary names rank 0 as the root cause. Why?",
             ("torchrun always names rank 0", "The error files keep whole seconds: a tie goes to the first failure "
              "in the agent's list", "Rank 0's error came first"), 1,
             "The error file's timestamp is int(time.time()); within one second torchrun cannot tell the order, and "
             "takes the first failure its agent listed.",
             "What resolution do the times in the error files have?"),
    Question("A cell calls torch.distributed.breakpoint(rank=1) under the notebook's launcher. What happens?",
             ("pdb opens in the notebook for rank 1", "Rank 1's pdb reads end of file from its standard input and "
              "quits (BdbQuit)", "Every rank stops in pdb"), 1,
             "A rank's standard input here is /dev/null: pdb needs a terminal, which torchrun run in a terminal gives "
             "it.",
             "Where does pdb read its commands from?"),
]
