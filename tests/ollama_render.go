// Renders an Ollama Modelfile TEMPLATE the way Ollama's chat endpoint does, for tests/test_gguf_ollama.py.
//
// Input (JSON on stdin): {"template": "...", "system": "the Modelfile's SYSTEM", "messages": [{"role", "content"}]}.
// Ollama puts the Modelfile's SYSTEM in front of a conversation that has no system message, then hands the
// template .System (every system message, joined) and .Messages (consecutive messages of one role merged; system
// messages stay in the list), and .Prompt (the last user message). Output: the prompt text on stdout.
package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type request struct {
	Template string    `json:"template"`
	System   string    `json:"system"`
	Messages []Message `json:"messages"`
}

func main() {
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		panic(err)
	}
	msgs := req.Messages
	if req.System != "" && (len(msgs) == 0 || msgs[0].Role != "system") {
		msgs = append([]Message{{Role: "system", Content: req.System}}, msgs...)
	}
	var system []string
	var merged []*Message
	for i := range msgs {
		m := msgs[i]
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if len(merged) > 0 && merged[len(merged)-1].Role == m.Role {
			merged[len(merged)-1].Content += "\n\n" + m.Content
		} else {
			merged = append(merged, &m)
		}
	}
	tmpl := template.Must(template.New("").Parse(req.Template))
	// A template that does not range over .Messages gets the last user message as .Prompt.
	prompt := ""
	for _, m := range merged {
		if m.Role == "user" {
			prompt = m.Content
		}
	}
	values := map[string]any{"System": strings.Join(system, "\n\n"), "Messages": merged, "Prompt": prompt,
		"Response": ""}
	if err := tmpl.Execute(os.Stdout, values); err != nil {
		panic(err)
	}
}
