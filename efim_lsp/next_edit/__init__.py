"""Next-edit suggestions: after an edit, the next place that needs the same change.

    didChange ─▶ EditHistory (keystrokes coalesced into one replacement per place)
              ─▶ propose(): the word the last change renamed, its next occurrence in the
                 enclosing function (below first, then above) ─▶ NextEdit
    textDocument/copilotInlineEdit ─▶ NextEdits (version and range checks, ids, counts)

No LSP types and no engine here: offsets are code points of the document's text, as in
the completer. The protocol lives in `efim_lsp.handlers.next_edit`. docs/design.md, "Next
edits".
"""
