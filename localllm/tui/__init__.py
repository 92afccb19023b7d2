"""`localllm chat`: the Textual chat app. The only package that imports textual."""
