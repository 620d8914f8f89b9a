"""autotune where people already train: thin adapters over the public API.

    autotune.integrations.hf           plan_training_args: TrainingArguments for an exact target batch;
                                       AutotuneBatchRamp, which refuses a batch ramp (the Trainer cannot follow one)
    autotune.integrations.lightning    AutotuneBatchSize (a Callback; ramp= grows the batch epoch by epoch),
                                       accumulator (manual optimization; ramp= at any step)
    autotune.integrations.accelerate   accumulator: an Accumulator wired to an Accelerator

Each builds a Workload from what the framework already has (the model, its
optimizer and loss, a real batch at its worst case), plans with the planner's
rules, and hands back the framework's own settings. The frameworks are optional
(``pip install autotune[hf]``, ``[lightning]``, ``[accelerate]``); importing
autotune imports none of them, and each module here imports only its own.

Owns: the adapters to Hugging Face, Lightning and Accelerate, and what they share. May import:
every stage below it and the api, and each module its own framework.
"""
