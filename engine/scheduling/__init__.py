"""The engine thread: the loop that takes arrivals and orders the work (`scheduler`), its
admission (`admission`), model steps (`steps`) and finishing (`finishing`), the KV budget's
working share (`working_share`), a request's state on the thread (`sequence`),
the model work of one step (`model_runner`: prefill steps, batched decode), prompt-lookup
speculation (`speculation`) and the documents' background pieces (`background`)."""
