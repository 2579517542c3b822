"""The lessons' quiz questions, with their answers and explanations: kept here rather than in the
notebooks' cells, where the right answer would sit in full view above the radio buttons."""

from ..quiz import Question


LESSON_0 = [
    Question("Four ranks hold 1, 4, 9 and 16, and each calls dist.all_reduce on its tensor. What does rank 2 hold after it?",
             ("9: all_reduce only sends", "30: the sum, on every rank", "7.5: the mean"), 1,
             "all_reduce sums (by default) every rank's tensor and leaves the result in place on every rank.",
             "What is combined, and who gets the result?"),
    Question("A %%torchrun cell calls record('x', value). Where does the value end up?",
             ("In the variable given by --out: run.ranks[r].facts['x'], one per rank", "In a file next to the notebook only",
              "Nowhere: record is only for printing"), 0,
             "Each rank's recorded values come back to the notebook: run.facts('x') lists them in rank order.",
             "Look at how the check above read rank and world_size."),
]


LESSON_1 = [
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
]


LESSON_2 = [
    Question("Four ranks each use a batch of 32. What batch does one optimizer step effectively see?",
             ("32 samples", "128 samples", "8 samples"), 1,
             "DDP averages the gradients of the 4 local batches: the step sees the global batch of 4 x 32 = 128.",
             "Every rank ends backward() holding the same gradient. Of which samples is it the gradient?"),
    Question("Which variable should pick a process's GPU?",
             ("RANK", "LOCAL_RANK", "WORLD_SIZE"), 1,
             "LOCAL_RANK counts processes on this machine, as the GPUs are numbered; RANK counts across machines.",
             "Think of the second machine of a job: how are its GPUs numbered?"),
    Question("You forgot sampler.set_epoch(epoch). What happens?",
             ("An error at the second epoch", "Every epoch sees the same sample order", "Ranks see overlapping data"),
             1,
             "Nothing fails: the shuffle is seeded with seed + epoch, and epoch stays 0, so the order repeats.",
             "What does DistributedSampler seed its shuffle with?"),
    Question("Why save model.module.state_dict() rather than model.state_dict()?",
             ("It is smaller", "It includes the optimizer", "Its keys have no 'module.' prefix, so they load into a plain model"),
             2,
             "The DDP wrapper adds 'module.' to every key; the inner model's state_dict is the plain one.",
             "Compare the keys the two print in step 8."),
    Question("Rank 0 loads a checkpoint into the model, then every rank wraps it in DDP. What do ranks 1 to 3 train?",
             ("Their own random initial weights", "The checkpoint's weights", "Nothing: DDP refuses models that differ"),
             1,
             "DDP broadcasts rank 0's parameters and buffers when it wraps the model, so every rank starts from the checkpoint.",
             "Step 4: what does the wrap do with rank 0's weights?"),
    Question("A data set of 10 samples on 4 ranks with DistributedSampler (drop_last=False). How many samples does each rank get?",
             ("2, and 2 samples are never seen", "3 each: 2 samples appear twice", "2 or 3: the shares are uneven"),
             1,
             "The sampler pads the index list to 12 by repeating samples, so every rank takes 3 and takes the same number of steps.",
             "Ranks that run different numbers of steps would wait for each other in a collective."),
    Question("Rank 0 saves a checkpoint and every rank then loads it. What is the barrier between the two for?",
             ("It makes saving faster", "It stops the other ranks from reading the file before rank 0 has written it",
              "It averages the weights before saving"),
             1,
             "Without it a rank can open the file while it is missing or half-written (FileNotFoundError, a torn load).",
             "Ranks run at their own pace between collectives."),
    Question("Why torch.load(path, map_location=...) when every rank loads rank 0's GPU checkpoint?",
             ("Without it every rank puts the tensors on the GPU they were saved from, cuda:0",
              "It decrypts the file", "It is required for weights_only=True"),
             0,
             "Tensors remember their device: without map_location all ranks would load onto cuda:0 and pile up there.",
             "Step 2's trap, in another place."),
    Question("Gradient accumulation over 4 micro-batches: what does model.no_sync() save?",
             ("Memory for activations", "The all-reduce of the first 3 micro-batches' gradients",
              "The optimizer step"),
             1,
             "Inside no_sync, backward() only accumulates locally; the all-reduce runs once, on the last micro-batch.",
             "Step 5 used no_sync to see one rank's own gradient: what did it skip?"),
    Question("Under DDP with a GradScaler, one step's gradients overflow on rank 1 only. What do the ranks do?",
             ("Rank 1 skips the step, the others take it", "Every rank skips the step and halves its scale",
              "The run stops with an error"),
             1,
             "The scaler's inf check is local, but it checks the gradients DDP averaged in backward(): rank 1's inf "
             "is in the sum on every rank, so every rank skips, and the weights stay equal.",
             "When the scaler looks for an inf, which gradients does each rank hold?"),
]


LESSON_3 = [
    Question("DDP runs with forward_sync_buffers=True (the default). Whose data do BatchNorm's running statistics describe?",
             ("Every rank's, averaged", "Rank 0's batches only", "The last rank's to finish"), 1,
             "Each forward starts from rank 0's buffers, updated with this rank's batch: rank 0's statistics never see another rank's data.",
             "Look at which reference line rank 0's running mean followed."),
    Question("You train on CPU ranks and call nn.SyncBatchNorm.convert_sync_batchnorm(model). What happens in training?",
             ("Statistics are synchronised over gloo", "It raises a ValueError: SyncBatchNorm needs GPU tensors",
              "It works, but slower"), 1,
             "SyncBatchNorm refuses CPU tensors in training (and without a process group it silently acts as plain BatchNorm).",
             "What did rank 0 record in the SyncBatchNorm cell?"),
    Question("A model with Adam in float32 has 1 billion parameters. About how much memory does one FSDP rank need for that state at world 8?",
             ("16 GB", "2 GB", "8 GB"), 1,
             "16 bytes per parameter is 16 GB, split 8 ways: 2 GB (plus the whole weights of the layer being computed).",
             "16 bytes per parameter, divided by the world size."),
    Question("Why can ZeRO-1 not split Adam's state evenly over 4 ranks for a model with two big weight matrices?",
             ("It gives each rank whole parameters", "gloo limits message sizes", "Adam's state cannot be split"), 0,
             "ZeroRedundancyOptimizer assigns whole parameters to ranks; FSDP splits every parameter.",
             "Compare the bars per rank at world 4."),
    Question("A job saved with torch.distributed.checkpoint on 2 ranks. Where can it resume?",
             ("Only on 2 ranks", "On any number of ranks, and in a plain process", "Only after converting with dcp_to_torch_save"), 1,
             "The metadata says which piece of which tensor is where; each loading rank reads what its own sharding needs.",
             "Look at the world sizes the checkpoint loaded at."),
    Question("A model is built on meta and sharded over 2 CPU ranks; after to_empty, each rank calls torch.manual_seed(0) "
             "and torch.nn.init.normal_ on its local shards (p.to_local()). What do the weights hold?",
             ("What one process would draw for the whole tensors", "Rank 1's rows repeat rank 0's numbers: the model "
              "changes with the world size", "Nothing: meta tensors cannot be initialised"), 1,
             "Each rank draws from the start of the same stream for its own rows. A rule per row of the whole tensor "
             "gives the same numbers at any world size (DTensor's own random ops on GPUs give each shard a stream of "
             "its own, but other numbers at another world size).",
             "Which numbers would one process give the second half of the rows?"),
]


LESSON_4 = [
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
    Question("A restarted job resumes from the right step but ends with slightly different weights. The likely cause?",
             ("The optimizer state was not saved", "Each rank's random state (dropout) was not restored",
              "The learning rate was too high"), 1,
             "The step's randomness (dropout masks, augmentation) comes from each rank's generator: save and restore it per rank.",
             "What else, besides weights and optimizer, decides what a step computes?"),
    Question("Nodes gpu-b and gpu-a run the same torchrun command with the c10d rendezvous; gpu-b starts a minute "
             "earlier and says --node-rank 0. Which one is machine 0 (GROUP_RANK 0)?",
             ("gpu-b: it arrived first", "gpu-b: it said --node-rank 0", "gpu-a: its name sorts first"), 2,
             "c10d ignores --node-rank and the order of arrival: it sorts the agents by (address, process id) and "
             "numbers them in that order.",
             "Look at which agent got GROUP_RANK 0 in the --local-addr demonstration."),
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


LESSON_5 = [
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

LESSON_6 = [
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
    Question("One batch takes 64 ms to read, and the step computes in 20 ms; the loader has num_workers=0. What does "
             "a network twice as fast do to the step?",
             ("Next to nothing: the step waits about 64 ms for each batch", "It halves the step", "It makes the step 20 ms"), 0,
             "The loop reads each batch itself before it computes: about 84 ms a step, whatever the all-reduce costs. "
             "Loader workers per rank read ahead, so the step becomes about the computation's 20 ms.",
             "Look at the 0-worker bar in the input-stall plot."),
    Question("How many buckets does DDP all-reduce in the first backward of a model with 8 MiB of gradients, with "
             "`bucket_cap_mb=1`?",
             ("8, one per MiB", "1: the buckets are built after the first step", "None: the first step does not "
              "communicate"), 1,
             "With the default find_unused_parameters=False, DDP's first backward puts every gradient in one bucket; "
             "then it rebuilds its buckets once, in the order the gradients became ready, closing each at its cap "
             "(torch/nn/parallel/distributed.py).",
             "Look at the first step of each cap in section 4."),
]


LESSON_7 = [
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
