// render: renders a Helm chart the way `helm template` does, without helm and
// without a cluster, so that the chart can be tested offline.
//
//	render --chart=DIR [--values=FILE]... [--release=NAME] [--namespace=NS]
//	       [--out=FILE] [--notes-out=FILE] [--values-out=FILE] [--strict]
//
// What it reproduces of Helm 3: Chart.yaml as .Chart (Name, Version,
// AppVersion, ...), values.yaml deep-merged with each --values file in order
// (later wins, a null deletes a key), numbers as float64 as Helm decodes them,
// .Release, .Capabilities (KubeVersion, APIVersions.Has), .Template (Name,
// BasePath), .Files (Get, GetBytes: the chart's files outside templates/;
// .helmignore is not applied), every template file as a named template
// "CHART/templates/FILE", partials (files starting with "_") not rendered,
// NOTES.txt rendered separately, sprig's functions without env/expandenv,
// and Helm's include, tpl, required, toYaml, fromYaml, toJson, fromJson,
// fromYamlArray, lookup (always empty, as in `helm template`). Output: each
// non-empty template as a document preceded by "# Source: ..." in file-name
// order. Exit status 1 with "Error: ..." on stderr when rendering fails, e.g.
// from `required` or `fail`.
//
// Builds with Debian's golang-go and golang-github-masterminds-sprig-dev
// (GO111MODULE=off GOPATH=/usr/share/gocode).
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v3"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func fatalf(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "Error: "+format+"\n", args...)
	os.Exit(1)
}

// toHelmValue converts decoded YAML into what Helm's values hold: the JSON
// data model (map[string]interface{}, []interface{}, float64, string, bool, nil).
func toHelmValue(v interface{}) (interface{}, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var out interface{}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	return out, nil
}

func readYAMLMap(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var raw interface{}
	if err := yaml.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	if raw == nil {
		return map[string]interface{}{}, nil
	}
	v, err := toHelmValue(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	m, ok := v.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("%s: top level must be a mapping", path)
	}
	return m, nil
}

// mergeValues merges src into dst as Helm merges a user's values over the
// chart's: maps merge recursively, anything else replaces, null deletes.
func mergeValues(dst, src map[string]interface{}) {
	for k, sv := range src {
		if sv == nil {
			delete(dst, k)
			continue
		}
		sm, sIsMap := sv.(map[string]interface{})
		dm, dIsMap := dst[k].(map[string]interface{})
		if sIsMap && dIsMap {
			mergeValues(dm, sm)
			continue
		}
		dst[k] = sv
	}
}

func toYAML(v interface{}) string {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return ""
	}
	enc.Close()
	return strings.TrimSuffix(buf.String(), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	var raw interface{}
	if err := yaml.Unmarshal([]byte(s), &raw); err != nil {
		m["Error"] = err.Error()
		return m
	}
	v, err := toHelmValue(raw)
	if err != nil {
		m["Error"] = err.Error()
		return m
	}
	if mm, ok := v.(map[string]interface{}); ok {
		return mm
	}
	return m
}

func fromYAMLArray(s string) []interface{} {
	var raw interface{}
	if err := yaml.Unmarshal([]byte(s), &raw); err != nil {
		return []interface{}{err.Error()}
	}
	v, _ := toHelmValue(raw)
	if a, ok := v.([]interface{}); ok {
		return a
	}
	return []interface{}{}
}

func toJSON(v interface{}) string {
	b, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(b)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

type files map[string][]byte

func (f files) Get(name string) string      { return string(f[name]) }
func (f files) GetBytes(name string) []byte { return f[name] }

type apiVersions []string

func (a apiVersions) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

// renderer holds one chart's parsed templates.
type renderer struct {
	tmpl     *template.Template
	includes int
}

func (r *renderer) funcs() template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	f["toYaml"] = toYAML
	f["fromYaml"] = fromYAML
	f["fromYamlArray"] = fromYAMLArray
	f["toJson"] = toJSON
	f["fromJson"] = fromJSON
	f["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return v, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return v, errors.New(msg)
		}
		return v, nil
	}
	f["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	// Placeholders so templates parse; replaced by closures over r below.
	f["include"] = func(string, interface{}) (string, error) { return "", nil }
	f["tpl"] = func(string, interface{}) (string, error) { return "", nil }
	return f
}

func (r *renderer) bind() {
	r.tmpl.Funcs(template.FuncMap{
		"include": func(name string, data interface{}) (string, error) {
			r.includes++
			defer func() { r.includes-- }()
			if r.includes > 1000 {
				return "", fmt.Errorf("include %q: nested too deep (recursion?)", name)
			}
			var buf bytes.Buffer
			if err := r.tmpl.ExecuteTemplate(&buf, name, data); err != nil {
				return "", err
			}
			return buf.String(), nil
		},
		"tpl": func(text string, data interface{}) (string, error) {
			t, err := r.tmpl.Clone()
			if err != nil {
				return "", err
			}
			t, err = t.New("tpl").Parse(text)
			if err != nil {
				return "", fmt.Errorf("tpl: %v", err)
			}
			var buf bytes.Buffer
			if err := t.Execute(&buf, data); err != nil {
				return "", err
			}
			return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
		},
	})
}

var execErrRe = regexp.MustCompile(`^template: ([^:]+(?::\d+)*):.*?error calling (?:required|fail): (.*)$`)

// helmError rewrites the error of a failed `required` or `fail` the way Helm
// prints it: "execution error at (FILE:LINE:COL): MESSAGE".
func helmError(err error) string {
	msg := err.Error()
	// text/template nests the include chain; the innermost call is last.
	if m := execErrRe.FindStringSubmatch(msg); m != nil {
		inner := m[2]
		for {
			mm := execErrRe.FindStringSubmatch(inner)
			if mm == nil {
				break
			}
			inner = mm[2]
		}
		return fmt.Sprintf("execution error at (%s): %s", m[1], inner)
	}
	return msg
}

func main() {
	var valueFiles multiFlag
	chartDir := flag.String("chart", "", "chart directory (holds Chart.yaml)")
	flag.Var(&valueFiles, "values", "values file merged over values.yaml (repeatable, later wins)")
	release := flag.String("release", "optimus", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	out := flag.String("out", "", "write the manifests here instead of stdout")
	notesOut := flag.String("notes-out", "", "write the rendered NOTES.txt here")
	valuesOut := flag.String("values-out", "", "write the merged values here as JSON")
	strict := flag.Bool("strict", false, "fail on a reference to a missing map key (helm lint --strict)")
	kubeVersion := flag.String("kube-version", "1.29.0", "Kubernetes version for .Capabilities")
	flag.Parse()
	if *chartDir == "" {
		fatalf("--chart is required")
	}

	chartMeta, err := readYAMLMap(filepath.Join(*chartDir, "Chart.yaml"))
	if err != nil {
		fatalf("reading Chart.yaml: %v", err)
	}
	chartName, _ := chartMeta["name"].(string)
	if chartName == "" {
		fatalf("Chart.yaml has no name")
	}
	chart := map[string]interface{}{}
	for k, v := range chartMeta {
		// Helm exposes Chart.yaml's fields capitalized: .Chart.AppVersion.
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}

	values, err := readYAMLMap(filepath.Join(*chartDir, "values.yaml"))
	if err != nil {
		fatalf("reading values: %v", err)
	}
	for _, vf := range valueFiles {
		override, err := readYAMLMap(vf)
		if err != nil {
			fatalf("reading values: %v", err)
		}
		mergeValues(values, override)
	}
	if *valuesOut != "" {
		b, _ := json.MarshalIndent(values, "", "  ")
		if err := os.WriteFile(*valuesOut, append(b, '\n'), 0o644); err != nil {
			fatalf("%v", err)
		}
	}

	tdir := filepath.Join(*chartDir, "templates")
	entries, err := os.ReadDir(tdir)
	if err != nil {
		fatalf("reading templates: %v", err)
	}
	r := &renderer{}
	r.tmpl = template.New(chartName).Funcs(r.funcs())
	if *strict {
		r.tmpl.Option("missingkey=error")
	} else {
		r.tmpl.Option("missingkey=zero")
	}
	var names []string
	chartFiles := files{}
	err = filepath.WalkDir(*chartDir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(*chartDir, p)
		if d.IsDir() {
			if rel == "templates" {
				return filepath.SkipDir
			}
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		chartFiles[filepath.ToSlash(rel)] = data
		return nil
	})
	if err != nil {
		fatalf("reading chart files: %v", err)
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(tdir, e.Name()))
		if err != nil {
			fatalf("%v", err)
		}
		name := chartName + "/templates/" + e.Name()
		if _, err := r.tmpl.New(name).Parse(string(data)); err != nil {
			fatalf("parse error: %v", err)
		}
		names = append(names, name)
	}
	sort.Strings(names)
	r.bind()

	kv := strings.SplitN(*kubeVersion, ".", 3)
	for len(kv) < 2 {
		kv = append(kv, "0")
	}
	caps := map[string]interface{}{
		"KubeVersion": map[string]interface{}{
			"Version": "v" + *kubeVersion, "GitVersion": "v" + *kubeVersion,
			"Major": kv[0], "Minor": kv[1],
		},
		"APIVersions": apiVersions{"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"},
		"HelmVersion": map[string]interface{}{"Version": "v3.14.0"},
	}
	top := func(name string) map[string]interface{} {
		return map[string]interface{}{
			"Values": values,
			"Chart":  chart,
			"Release": map[string]interface{}{
				"Name": *release, "Namespace": *namespace, "Service": "Helm",
				"IsInstall": true, "IsUpgrade": false, "Revision": 1,
			},
			"Capabilities": caps,
			"Template":     map[string]interface{}{"Name": name, "BasePath": chartName + "/templates"},
			"Files":        chartFiles,
		}
	}

	var manifests bytes.Buffer
	notes := ""
	for _, name := range names {
		base := filepath.Base(name)
		if strings.HasPrefix(base, "_") {
			continue
		}
		var buf bytes.Buffer
		if err := r.tmpl.ExecuteTemplate(&buf, name, top(name)); err != nil {
			fatalf("%s", helmError(err))
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if base == "NOTES.txt" {
			notes = text
			continue
		}
		for _, doc := range splitDocs(text) {
			fmt.Fprintf(&manifests, "---\n# Source: %s\n%s\n", name, doc)
		}
	}
	if *out == "" {
		os.Stdout.Write(manifests.Bytes())
	} else if err := os.WriteFile(*out, manifests.Bytes(), 0o644); err != nil {
		fatalf("%v", err)
	}
	if *notesOut != "" {
		if err := os.WriteFile(*notesOut, []byte(notes), 0o644); err != nil {
			fatalf("%v", err)
		}
	}
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// splitDocs cuts a template's output at "---" lines and drops documents that
// hold only whitespace and comments, as Helm does.
func splitDocs(text string) []string {
	var docs []string
	for _, d := range docSep.Split(text, -1) {
		empty := true
		for _, line := range strings.Split(d, "\n") {
			t := strings.TrimSpace(line)
			if t != "" && !strings.HasPrefix(t, "#") {
				empty = false
				break
			}
		}
		if !empty {
			docs = append(docs, strings.Trim(d, "\n"))
		}
	}
	return docs
}
