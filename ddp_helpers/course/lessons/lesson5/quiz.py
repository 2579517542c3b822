"""Lesson 5's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Rank 0 waits in all_reduce #7; rank 1's last collective was #6 and it is now in a loop writing a file. "
             "What is the likely cause?",
             ("The network is slow", "Rank 1 skipped a collective that rank 0 called, such as one inside `if rank == 0:`",
              "The all_reduce is too large"), 1,
             "Every rank must call the same collectives in the same order; #7 exists on rank 0 only.",
             "Compare the collective numbers the ranks reached."),
    Question("What does TORCH_DISTRIBUTED_DEBUG=DETAIL do with a mismatched all_reduce?",
             ("Nothing: it only adds logging", "It fixes the shapes",
              "It checks every collective across the ranks first and raises, naming both sides"), 2,
             "A wrapper compares sequence number, kind, shapes and dtypes before each collective, and raises at once: "
             "useful for a debugging run, costly for training.",
             "Look at the cell that failed at once, and at the cost it measured."),
    Question("Rank 3 raised ValueError; ranks 0, 1 and 2 then failed with 'Connection closed by peer'. Which error "
             "do you fix?",
             ("Rank 3's ValueError", "Connection closed by peer", "All four equally"), 0,
             "The first failure in time is the root cause; the peers failed because rank 3 was gone.",
             "Which failure happened first?"),
    Question("DDP is wrapped after a seed per rank, and later rank 1 scales a weight in place under no_grad. What happens?",
             ("DDP raises an error at the next step", "Nothing visible: the ranks keep training different weights",
              "DDP averages the weights back together"), 1,
             "DDP broadcasts rank 0's weights once, at the wrap; then it averages gradients (and re-broadcasts "
             "buffers before each forward), never parameters: a change outside backward on one rank stays.",
             "What does DDP synchronise after the wrap?"),
]
