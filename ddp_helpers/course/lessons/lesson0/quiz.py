"""Lesson 0's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Four ranks hold 1, 4, 9 and 16, and each calls dist.all_reduce on its tensor. What does rank 2 hold after it?",
             ("9: all_reduce only sends", "30: the sum, on every rank", "7.5: the mean"), 1,
             "all_reduce sums (by default) every rank's tensor and leaves the result in place on every rank.",
             "What is combined, and who gets the result?"),
    Question("Both ranks ran the same hello cell, yet each printed its own rank. Where does the difference come from?",
             ("The notebook sends each rank a different copy of the cell",
              "torchrun starts the same script in every process and gives each its own RANK and WORLD_SIZE, which "
              "`init_process_group` reads",
              "The ranks take turns: rank 1 runs once rank 0 has finished"), 1,
             "One program, many processes: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and where to meet, "
             "MASTER_ADDR and MASTER_PORT) in each process's environment, and init_process_group's default env:// "
             "reads them. A script does different work on different ranks only where it branches on its rank.",
             "What did each process get from torchrun before the script's first line ran?"),
    Question("Two ranks hold [1, 2, 3, 4] and [5, 6, 7, 8]. Each calls dist.reduce_scatter(out, list(t.chunk(2))). "
             "What does rank 1's out hold?",
             ("[6, 8]", "[10, 12]", "[5, 6, 7, 8]"), 1,
             "The sum over the ranks of each chunk i lands on rank i: rank 1 gets [3 + 7, 4 + 8]. All-gathering the "
             "pieces then gives every rank the whole sum: an all-reduce.",
             "Which chunk is rank 1's piece, and what is combined over the ranks?"),
    Question("On nccl, `work = dist.all_reduce(t, async_op=True); work.wait(); start = time.perf_counter()`. "
             "When has the sum arrived in t?",
             ("When wait() returns: it blocks until the data is there",
              "When the GPU has run it: wait() only makes the GPU's stream wait",
              "Never: with async_op the result goes to a callback"), 1,
             "On nccl wait() returns at once, having queued the wait on the GPU's current stream; the next kernels "
             "see the sum, the host only after synchronising. On gloo wait() does return once the data is there.",
             "What does Work.wait's docstring say it does on nccl?"),
]
