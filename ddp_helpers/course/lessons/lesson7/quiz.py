"""Lesson 7's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("In section 2, `register_post_accumulate_grad_hook` starts each gradient's all-reduce with `async_op=True`. "
             "What goes wrong if the loop calls `optimizer.step()` without waiting on the handles?",
             ("Nothing: the hook already sent the gradient", "The step may read gradients whose all-reduce has not "
              "finished, so ranks step with different values", "The all-reduce is cancelled"), 1,
             "async_op=True returns before the all-reduce is done; it writes the result into the tensor later, from "
             "gloo's thread or nccl's stream. Only after wait() does .grad hold the average on every rank.",
             "What does async_op=True return, and when is the tensor's value final?"),
    Question("In the order the backward produces them, a model's gradients hold 4, 300, 300 and 600 KiB. Into how many "
             "buckets does torch DDP's rule put them with a 512 KiB cap (a bucket closes once it holds at least the cap)?",
             ("2", "3", "4"), 0,
             "4 + 300 = 304 KiB stays open; adding 300 makes 604 KiB, which reaches the cap and closes the first "
             "bucket; 600 KiB alone reaches it again: 2 buckets.",
             "Add the sizes in order, and close the bucket when the sum first reaches the cap."),
    Question("Why does a larger bucket cap not always make the step faster?",
             ("Larger all-reduces move more bytes", "A bucket's all-reduce cannot start before its last gradient is "
              "ready: with one big bucket nothing overlaps the backward", "gloo refuses tensors over 25 MiB"), 1,
             "The bytes are the same at every cap. Fewer buckets pay the latency fewer times, but start later; with "
             "one bucket, all the communication comes after the backward.",
             "What must be ready before a bucket's all-reduce can start?"),
    Question("With ZeRO-1 on 4 ranks and Adam, what does each rank keep, against plain DDP?",
             ("A quarter of the parameters", "All the parameters and gradients, and about a quarter of Adam's state",
              "A quarter of the gradients"), 1,
             "Stage 1 shards only the optimizer's state: every rank still holds the whole model and averages every "
             "gradient, and each owner broadcasts the parameters it updated. Stage 2 shards the gradients, "
             "stage 3 (FSDP) the parameters too.",
             "Which of the model's tensors does stage 1 shard, and which does it leave whole?"),
]
