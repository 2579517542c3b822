"""Lesson 1's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("In data parallelism by hand, why divide the all-reduced gradient by the world size?",
             ("To make the all-reduce faster", "So that it is the mean over the whole batch, as one process would compute",
              "Because each rank holds a part of the model"), 1,
             "all_reduce sums the ranks' gradients; divided by the world size it is the gradient of the mean loss on the whole batch.",
             "What does one process compute with a mean loss over the whole batch?"),
    Question("A two-stage pipeline runs the batch as 4 micro-batches. About what share of the time does each stage idle?",
             ("1/2", "1/5", "0"), 1,
             "(p - 1) / (m + p - 1) = 1 / 5 with p = 2 stages and m = 4 micro-batches.",
             "Look at the formula and the plot above."),
    Question("What travels between the two stages of a pipeline?",
             ("The weights of the layers", "The activation at the cut, and its gradient back", "The gradients of all parameters"),
             1,
             "Each stage keeps its own layers; only the activation goes forward and its gradient comes back.",
             "Compare the bytes sent for the small and the big model."),
    Question("A model, its gradients and Adam's state need 3 times one GPU's memory; the job has 8 GPUs in one "
             "machine. What do you reach for first?",
             ("Pipeline parallelism: 8 stages of the model", "Sharded data parallelism: FSDP or ZeRO",
              "Tensor parallelism: every layer split 8 ways"), 1,
             "Data parallelism stays the simplest program; sharding its state divides the memory by the ranks for "
             "1 to 1.5 times the bytes. Split the model itself only when that is not enough.",
             "Which choice keeps the training script as it is?"),
]
