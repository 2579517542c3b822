"""Lesson 6's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("On a machine, an all-reduce of 1 KiB takes 0.8 ms and one of 16 MiB 20 ms. In alpha + bytes / beta, what makes up "
             "most of the 1 KiB one's time?",
             ("alpha, the latency", "bytes / beta, the bandwidth term", "Neither: it is noise"), 0,
             "1 KiB at a bandwidth of about 1 GB/s is about 1 us: nearly all of 0.8 ms is the fixed cost of a collective. "
             "Many small all-reduces pay it many times; that is why DDP buckets gradients.",
             "Compute 1 KiB / beta with the fitted beta."),
    Question("nccl-tests report an algorithm bandwidth of 200 GB/s for an all-reduce on 8 GPUs. What bus bandwidth do "
             "they report?",
             ("200 GB/s", "350 GB/s", "1600 GB/s"), 1,
             "Bus bandwidth = algorithm bandwidth x 2(W-1)/W = 200 x 14/8: what each GPU's links carry in a ring, "
             "comparable with the link's speed.",
             "The ring factor at W = 8."),
    Question("You measure a compute-only backward with the forward outside `with ddp.no_sync():` and only "
             "`loss.backward()` inside. What does the backward do?",
             ("It communicates nothing", "It still all-reduces every bucket", "It raises an error"), 1,
             "DDP decides during the forward whether the next backward all-reduces (it prepares its reducer there): "
             "put the forward inside no_sync too.",
             "Where does DDP read require_backward_grad_sync?"),
    Question("A 200-step run registers `powerSGD_hook` with `PowerSGDState(process_group=None)` and nothing else. How "
             "many bytes does each step send, against the plain all-reduce?",
             ("Far fewer: it compresses", "Half", "The same: it has not started compressing"), 2,
             "start_powerSGD_iter defaults to 1000: the first 1000 steps run a plain all-reduce.",
             "Look at PowerSGDState's defaults."),
    Question("How many buckets does DDP all-reduce in the first backward of a model with 8 MiB of gradients, with "
             "`bucket_cap_mb=1`?",
             ("8, one per MiB", "1: the buckets are built after the first step", "None: the first step does not "
              "communicate"), 1,
             "With the default find_unused_parameters=False, DDP's first backward puts every gradient in one bucket; "
             "then it rebuilds its buckets once, in the order the gradients became ready, closing each at its cap "
             "(torch/nn/parallel/distributed.py).",
             "Look at the first step of each cap in section 4."),
    Question("A step runs its batch as 4 micro-batches, each with its own forward and backward, under DDP. How many "
             "times a step does DDP all-reduce the gradients with the first 3 under `with ddp.no_sync():`?",
             ("4: no_sync only delays them", "Once, in the last micro-batch's backward, on the gradients summed "
              "over the 4", "Never: the gradients stay on each rank"), 1,
             "Under no_sync backward only adds the gradients up on the rank; the next backward outside it all-reduces "
             "the sum: a quarter of the bytes a step, the same gradient.",
             "What does backward do with a gradient inside no_sync?"),
]
