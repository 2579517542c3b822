"""Deep dive 6b's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("A profile of a DDP step shows every all-reduce starting after the backward's last operator. What does "
             "that tell you?",
             ("Nothing: the profiler always shows them there", "No communication overlapped the backward in that "
              "step: one bucket for every gradient, or a hook that waits", "The all-reduces were skipped"), 1,
             "DDP launches a bucket's all-reduce as soon as its gradients are ready, during the backward; all of them "
             "after its end means one bucket, or something holding them back.",
             "When does DDP launch a bucket's all-reduce?"),
    Question("One batch takes 64 ms to read, and the step computes in 20 ms; the loader has num_workers=0. What does "
             "a network twice as fast do to the step?",
             ("Next to nothing: the step waits about 64 ms for each batch", "It halves the step", "It makes the step 20 ms"), 0,
             "The loop reads each batch itself before it computes: about 84 ms a step, whatever the all-reduce costs. "
             "Loader workers per rank read ahead, so the step becomes about the computation's 20 ms.",
             "Look at the 0-worker bar in the input-stall plot."),
]
