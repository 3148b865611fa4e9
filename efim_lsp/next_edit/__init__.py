"""Next-edit suggestions: after an edit, the next place that needs the same change.

    didChange ─▶ EditHistory (keystrokes coalesced into one replacement per place)
              ─▶ dispatch.propose(), the first that answers:
                 proposer    the word the last change renamed, its next occurrence in the
                             enclosing function (below first, then above)
                 call_sites  a parameter added to / dropped from a def: the next call that
                             does not fit the new signature
                 parallel    one of a run of lines of the same shape changed: the same change
                             on the next line of the run
              ─▶ NextEdit
              ─▶ other_files.remember(): a module-level def/class/assignment renamed,
                 kept server-wide (the last 8)
    textDocument/copilotInlineEdit ─▶ NextEdits (version and range checks, ids, counts);
                 where dispatch is silent, other_files.propose(): the same rename where this
                 document imports the renamed module (`from a import foo`, `a.foo`, `m.foo`);
                 with nextEdit "model", where those are silent too, probe: the changed
                 token's candidate places, each asked of the model after the document's
                 prompt (the completer runs the probes)

No LSP types and no engine here: offsets are code points of the document's text, as in
the completer. The protocol lives in `efim_lsp.handlers.next_edit`. docs/design.md, "Next
edits".
"""
