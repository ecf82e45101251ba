/* The CUDA redirect's hot wrappers in C: torch.empty(..., device='cuda'), Tensor.to('cuda') and their kin.
 *
 * A Python wrapper costs a frame, an args tuple and a kwargs dict on every call, 0.4-1.2 us on this
 * machine, which is more than the redirect may add (docs/cuda-scripts.md). This type forwards with
 * vectorcall and touches the arguments only when one names a device: a call that names none pays one
 * keyword-name scan.
 *
 * Semantics are those of wrappers.py's Python fallbacks, which the tests run against the same specification:
 *   position < 0: only the `device` keyword is mapped (factories, Tensor.new_*);
 *   position >= 0: when a positional argument sits there it is mapped if its type is one of `kinds`
 *                  (or any type when kinds is None); otherwise the `device` keyword is.
 * A mapped value is looked up in DeviceMap's memo dict and computed by calling DeviceMap on a miss.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *devices; /* DeviceMap: spec -> mapped, memoising */
    PyObject *memo;    /* DeviceMap's memo dict, read here without a call */
    PyObject *kinds;   /* tuple of exact types, or NULL for any */
    Py_ssize_t position;
    PyObject *dict;    /* functools.update_wrapper and __devshim_original__ live here */
    PyObject *weakrefs; /* torch._dynamo.allow_in_graph keeps a weak reference */
    vectorcallfunc vectorcall;
} DeviceArgument;

static PyObject *device_name; /* interned "device" */

static PyObject *map_device(DeviceArgument *self, PyObject *spec) {
    PyObject *mapped = PyDict_GetItemWithError(self->memo, spec);
    if (mapped != NULL) {
        Py_INCREF(mapped);
        return mapped;
    }
    PyErr_Clear(); /* a miss, or an unhashable spec: DeviceMap decides both */
    return PyObject_CallOneArg(self->devices, spec);
}

/* Call the original with args[slot] replaced by its mapped value. */
static PyObject *call_mapped(DeviceArgument *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                             Py_ssize_t slot) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[16];
    PyObject **copy = small;
    if (total > 16) {
        copy = PyMem_Malloc(total * sizeof(PyObject *));
        if (copy == NULL) return PyErr_NoMemory();
    }
    memcpy(copy, args, total * sizeof(PyObject *));
    PyObject *mapped = map_device(self, args[slot]);
    PyObject *result = NULL;
    if (mapped != NULL) {
        copy[slot] = mapped;
        result = PyObject_Vectorcall(self->original, copy, nargs, kwnames);
        Py_DECREF(mapped);
    }
    if (copy != small) PyMem_Free(copy);
    return result;
}

static int is_kind(DeviceArgument *self, PyObject *value) {
    if (self->kinds == NULL) return 1;
    PyTypeObject *type = Py_TYPE(value);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->kinds); i++) {
        if ((PyObject *)type == PyTuple_GET_ITEM(self->kinds, i)) return 1;
    }
    return 0;
}

static PyObject *device_argument_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    DeviceArgument *self = (DeviceArgument *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->position >= 0 && nargs > self->position) {
        if (is_kind(self, args[self->position])) return call_mapped(self, args, nargs, kwnames, self->position);
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    }
    if (kwnames != NULL) {
        Py_ssize_t count = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i);
            if (name == device_name || PyUnicode_Compare(name, device_name) == 0) {
                if (args[nargs + i] == Py_None) break;
                return call_mapped(self, args, nargs, kwnames, nargs + i);
            }
        }
    }
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

/* Bound like a function: Tensor.to as an attribute of a tensor gets the tensor first. With
 * Py_TPFLAGS_METHOD_DESCRIPTOR, x.to(...) skips the bound object and calls with x prepended. */
static PyObject *device_argument_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

/* pickle: by name in its module (update_wrapper set both), so that it unpickles as what that name is now. */
static PyObject *device_argument_reduce(PyObject *self, PyObject *unused) {
    return PyObject_GetAttrString(self, "__name__");
}

static PyObject *device_argument_repr(DeviceArgument *self) {
    return PyUnicode_FromFormat("<devshim CUDA redirect of %R>", self->original);
}

static int device_argument_traverse(DeviceArgument *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->devices);
    Py_VISIT(self->memo);
    Py_VISIT(self->kinds);
    Py_VISIT(self->dict);
    return 0;
}

static int device_argument_clear(DeviceArgument *self) {
    Py_CLEAR(self->original);
    Py_CLEAR(self->devices);
    Py_CLEAR(self->memo);
    Py_CLEAR(self->kinds);
    Py_CLEAR(self->dict);
    return 0;
}

static void device_argument_dealloc(DeviceArgument *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    device_argument_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef device_argument_methods[] = {
    {"__reduce__", device_argument_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef device_argument_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DeviceArgumentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "devshim_core.integrations.cuda_redirect._native.DeviceArgument",
    .tp_doc = "A callable that maps a CUDA device argument, then calls the original with vectorcall.",
    .tp_basicsize = sizeof(DeviceArgument),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DeviceArgument, vectorcall),
    .tp_dictoffset = offsetof(DeviceArgument, dict),
    .tp_weaklistoffset = offsetof(DeviceArgument, weakrefs),
    .tp_descr_get = device_argument_get,
    .tp_repr = (reprfunc)device_argument_repr,
    .tp_dealloc = (destructor)device_argument_dealloc,
    .tp_traverse = (traverseproc)device_argument_traverse,
    .tp_clear = (inquiry)device_argument_clear,
    .tp_methods = device_argument_methods,
    .tp_getset = device_argument_getset,
};

static PyObject *device_argument(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"original", "devices", "memo", "position", "kinds", NULL};
    PyObject *original, *devices, *memo, *kinds = Py_None;
    Py_ssize_t position = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!|nO:device_argument", keywords, &original, &devices,
                                     &PyDict_Type, &memo, &position, &kinds))
        return NULL;
    if (kinds != Py_None && !PyTuple_Check(kinds)) {
        PyErr_SetString(PyExc_TypeError, "kinds must be a tuple of types or None");
        return NULL;
    }
    DeviceArgument *self = PyObject_GC_New(DeviceArgument, &DeviceArgumentType);
    if (self == NULL) return NULL;
    Py_INCREF(original);
    Py_INCREF(devices);
    Py_INCREF(memo);
    self->original = original;
    self->devices = devices;
    self->memo = memo;
    self->kinds = NULL;
    if (kinds != Py_None) {
        Py_INCREF(kinds);
        self->kinds = kinds;
    }
    self->position = position;
    self->dict = NULL;
    self->weakrefs = NULL;
    self->vectorcall = device_argument_call;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyMethodDef module_methods[] = {
    {"device_argument", (PyCFunction)(void (*)(void))device_argument, METH_VARARGS | METH_KEYWORDS,
     "device_argument(original, devices, memo, position=-1, kinds=None): a wrapper mapping one device argument."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_native", "The CUDA redirect's wrappers, compiled.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&DeviceArgumentType) < 0) return NULL;
    device_name = PyUnicode_InternFromString("device");
    if (device_name == NULL) return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL) return NULL;
    Py_INCREF(&DeviceArgumentType);
    if (PyModule_AddObject(module, "DeviceArgument", (PyObject *)&DeviceArgumentType) < 0) {
        Py_DECREF(&DeviceArgumentType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
