"""radixrt.lang: the frontend DSL (gen, select, fork, ...). Built in a later step; it
will talk to the runtime only over HTTP or through `radixrt.Engine`, and never imports torch."""
