"""Clinical content of the synthetic cohort: one readable definition per condition.

Rates are annual, at age 60, before risk multipliers (see `model.Hazard`). Every ICD-10-CM code is
checked against the official FY2026 tabular list (`simple_icd_10_cm`) when this module is loaded:
it must exist and be billable. ICD-10-PCS codes are real codes for the procedures named.
`docs/synthetic.md` is generated from these records (`python -m warehouse.synthetic.docs`).
"""

from __future__ import annotations

import simple_icd_10_cm as icd

from dxr.errors import ConfigError
from warehouse.synthetic.model import Chronic, Complication, Hazard, Procedure, Reason, Rule, extra

H, R = Hazard, Rule

# ---------------------------------------------------------------------------------------------
# Chronic states: diseases, stages and durable statuses
# ---------------------------------------------------------------------------------------------
CHRONIC: tuple[Chronic, ...] = (
    Chronic(
        "hypertension", "Essential hypertension and its heart/kidney combinations",
        H(0.02, per_decade=1.45, risks={"obesity": 1.8, "t2dm": 1.5, "ckd": 1.8}, ages=(25, 130)),
        (R({"I13.0": 0.9, "I13.10": 0.1}, "heart_failure ckd !ckd:esrd"),
         R({"I13.2": 1.0}, "heart_failure ckd:esrd"),
         R({"I11.0": 1.0}, "heart_failure"),
         R({"I12.9": 1.0}, "ckd !ckd:esrd"),
         R({"I12.0": 1.0}, "ckd:esrd"),
         R({"I10": 0.9, "I11.9": 0.1})),
        0.75,
        "ICD-10-CM presumes a causal link between hypertension and heart failure or CKD, so the "
        "combination category (I11/I12/I13) replaces I10 once either appears; the CKD stage is "
        "coded separately by the CKD state.",
        meds=(("", "lisinopril"), ("", "amlodipine")),
    ),
    Chronic(
        "hyperlipidemia", "Hyperlipidaemia",
        H(0.02, per_decade=1.3, risks={"t2dm": 1.6, "obesity": 1.4}, ages=(25, 130)),
        (R({"E78.5": 0.55, "E78.00": 0.2, "E78.2": 0.15, "E78.49": 0.1}),),
        0.45,
        "Very common, often coded as unspecified hyperlipidaemia; specific siblings vary by coder.",
        meds=(("", "atorvastatin"),),
    ),
    Chronic(
        "t2dm", "Type 2 diabetes mellitus",
        H(0.006, per_decade=1.35, risks={"obesity": 3.0, "hypertension": 1.3}, ages=(25, 130)),
        (R({"E11.22": 0.85, "E11.9": 0.15}, "ckd"),
         R({"E11.65": 0.65, "E11.9": 0.35}, "hba1c_high"),
         R({"E11.9": 0.8, "E11.69": 0.1, "E11.8": 0.1})),
        0.85,
        "Diabetic CKD is coded E11.22 (with the N18 stage from the CKD state); poor control "
        "(latent HbA1c > 9%) shows as E11.65; otherwise mostly E11.9.",
        also=(extra("Z79.84", 0.45, "!insulin_use"),),
        meds=(("!insulin_use", "metformin"),),
    ),
    Chronic(
        "t1dm", "Type 1 diabetes mellitus",
        H(0.00006, per_decade=0.75, ages=(3, 50), risks={"t2dm": 0.0}),
        (R({"E10.22": 1.0}, "ckd"),
         R({"E10.65": 0.6, "E10.9": 0.4}, "hba1c_high"),
         R({"E10.9": 0.85, "E10.69": 0.15})),
        0.95,
        "Autoimmune diabetes starting young; always on insulin; DKA is its typical acute event.",
    ),
    Chronic(
        "insulin_use", "Long-term (current) use of insulin",
        H(0.03, risks={"hba1c_high": 3.0, "ckd": 1.5, "t1dm": 1000.0}, requires="diabetes", cap=1000.0),
        (R({"Z79.4": 1.0}),),
        0.75,
        "Type 2 diabetes escalates to insulin (faster when poorly controlled); type 1 starts on it.",
        meds=(("", "insulin glargine"), ("", "insulin lispro")),
    ),
    Chronic(
        "diabetic_neuropathy", "Diabetic polyneuropathy",
        H(0.03, risks={"hba1c_high": 2.0}, requires="diabetes"),
        (R({"E10.42": 1.0}, "t1dm"), R({"E11.42": 0.6, "E11.40": 0.4})),
        0.55,
        "Distal symmetric neuropathy accumulates with diabetes duration and poor control.",
        meds=(("", "gabapentin"),),
    ),
    Chronic(
        "diabetic_retinopathy", "Diabetic retinopathy",
        H(0.025, risks={"hba1c_high": 2.0, "hypertension": 1.3}, requires="diabetes"),
        (R({"E10.3293": 0.6, "E10.3593": 0.4}, "t1dm", sticky=True),
         R({"E11.3293": 0.45, "E11.3393": 0.25, "E11.3593": 0.15, "E11.319": 0.15}, sticky=True)),
        0.4,
        "Retinopathy severity/laterality is stable for a patient (sticky code); rarely coded on "
        "medical admissions.",
    ),
    Chronic(
        "ckd", "Chronic kidney disease",
        H(0.004, per_decade=1.8, risks={"diabetes": 3.0, "hypertension": 2.0, "heart_failure": 1.8}, ages=(30, 130)),
        (R({"N18.2": 0.85, "N18.9": 0.15}, "ckd:stage2"),
         R({"N18.31": 0.6, "N18.30": 0.3, "N18.9": 0.1}, "ckd:stage3a"),
         R({"N18.32": 0.6, "N18.30": 0.3, "N18.9": 0.1}, "ckd:stage3b"),
         R({"N18.4": 1.0}, "ckd:stage4"),
         R({"N18.5": 1.0}, "ckd:stage5"),
         R({"N18.6": 1.0}, "ckd:esrd")),
        0.85,
        "Stages progress 2 → 3a → 3b → 4 → 5 → ESRD (faster with diabetes); stage 3 is often coded "
        "as unspecified N18.30, so the code lags the true stage.",
        stages=("stage2", "stage3a", "stage3b", "stage4", "stage5", "esrd"),
        initial=(0.4, 0.35, 0.15, 0.1, 0.0, 0.0),
        progression={
            "stage2": ("stage3a", H(0.08, risks={"diabetes": 1.5})),
            "stage3a": ("stage3b", H(0.08, risks={"diabetes": 1.5, "heart_failure": 1.3})),
            "stage3b": ("stage4", H(0.07, risks={"diabetes": 1.5})),
            "stage4": ("stage5", H(0.1, risks={"diabetes": 1.4})),
            "stage5": ("esrd", H(0.35)),
        },
        meds=(("ckd:esrd", "sevelamer"), ("ckd:stage5", "sevelamer")),
    ),
    Chronic(
        "dialysis", "Dependence on renal dialysis",
        H(4.0, requires="ckd:esrd"),
        (R({"Z99.2": 1.0}),),
        0.85,
        "End-stage renal disease starts maintenance haemodialysis within months.",
    ),
    Chronic(
        "heart_failure", "Chronic heart failure",
        H(0.0018, per_decade=2.0, risks={"hypertension": 2.0, "cad": 2.2, "old_mi": 2.5, "atrial_fibrillation": 1.8,
                                       "t2dm": 1.5, "obesity": 1.4, "valvular_disease": 2.0}, ages=(30, 130)),
        (R({"I50.22": 0.6, "I50.20": 0.2, "I50.9": 0.2}, "heart_failure:hfref"),
         R({"I50.32": 0.6, "I50.30": 0.2, "I50.9": 0.2}, "heart_failure:hfpef"),
         R({"I50.42": 0.6, "I50.40": 0.2, "I50.9": 0.2}, "heart_failure:combined")),
        0.85,
        "Subtype (reduced, preserved, combined ejection fraction) is fixed at onset; chronic codes "
        "I50.x2 between episodes, acute-on-chronic I50.x3 during exacerbations (see hf_exacerbation).",
        stages=("hfref", "hfpef", "combined"),
        initial=(0.42, 0.48, 0.1),
        meds=(("", "furosemide"), ("heart_failure:hfref", "carvedilol"),
              ("heart_failure:hfref", "sacubitril-valsartan")),
    ),
    Chronic(
        "atrial_fibrillation", "Atrial fibrillation",
        H(0.0025, per_decade=2.0, risks={"hypertension": 1.5, "heart_failure": 2.0, "obesity": 1.4, "osa": 1.5,
                                       "valvular_disease": 1.8}, ages=(30, 130)),
        (R({"I48.0": 0.6, "I48.91": 0.4}, "atrial_fibrillation:paroxysmal"),
         R({"I48.19": 0.5, "I48.11": 0.2, "I48.91": 0.3}, "atrial_fibrillation:persistent"),
         R({"I48.21": 0.6, "I48.20": 0.1, "I48.91": 0.3}, "atrial_fibrillation:permanent")),
        0.85,
        "Paroxysmal AF tends to become persistent and then permanent; unspecified I48.91 is common.",
        stages=("paroxysmal", "persistent", "permanent"),
        initial=(0.6, 0.3, 0.1),
        progression={"paroxysmal": ("persistent", H(0.12)), "persistent": ("permanent", H(0.15))},
        meds=(("", "metoprolol"),),
    ),
    Chronic(
        "anticoagulation", "Long-term (current) use of anticoagulants",
        H(1.2, requires="anticoag_indication"),
        (R({"Z79.01": 1.0}),),
        0.75,
        "Atrial fibrillation or a venous thromboembolism leads to long-term anticoagulation "
        "(apixaban mostly, warfarin for some — then INR is monitored).",
        stages=("doac", "warfarin"),
        initial=(0.75, 0.25),
        meds=(("anticoagulation:doac", "apixaban"), ("anticoagulation:warfarin", "warfarin")),
    ),
    Chronic(
        "cad", "Coronary atherosclerosis",
        H(0.005, per_decade=1.6, female=0.5, risks={"hypertension": 1.6, "hyperlipidemia": 1.8, "diabetes": 2.0,
                                                   "smoker": 2.0, "ckd": 1.5}, ages=(30, 130)),
        (R({"I25.810": 0.3, "I25.10": 0.7}, "cabg_status"),
         R({"I25.10": 0.8, "I25.119": 0.1, "I25.118": 0.1})),
        0.65,
        "Stable coronary disease, the substrate of infarction and of coronary bypass surgery.",
        also=(extra("Z79.82", 0.35),),
        meds=(("", "aspirin"), ("", "atorvastatin")),
    ),
    Chronic(
        "old_mi", "Old myocardial infarction", None,
        (R({"I25.2": 1.0}),), 0.6,
        "Set by an acute myocardial infarction; coded as I25.2 on later stays.",
        also=(extra("Z79.02", 0.3),),
        meds=(("", "clopidogrel"),),
    ),
    Chronic(
        "coronary_stent", "Presence of coronary stent", None,
        (R({"Z95.5": 1.0}),), 0.55,
        "Set by a percutaneous coronary intervention during an infarction admission.",
    ),
    Chronic(
        "cabg_status", "Presence of coronary bypass graft", None,
        (R({"Z95.1": 1.0}),), 0.7,
        "Set by elective coronary artery bypass grafting.",
    ),
    Chronic(
        "pacemaker", "Presence of cardiac pacemaker", None,
        (R({"Z95.0": 1.0}),), 0.7,
        "Set by pacemaker insertion for symptomatic bradycardia.",
    ),
    Chronic(
        "valvular_disease", "Valvular heart disease",
        H(0.003, per_decade=2.0, ages=(40, 130)),
        (R({"I35.0": 0.5, "I34.0": 0.35, "I35.1": 0.15}, sticky=True),),
        0.6,
        "Aortic stenosis or mitral regurgitation of the elderly; the lesion is fixed per patient.",
    ),
    Chronic(
        "pulmonary_hypertension", "Pulmonary hypertension",
        H(0.003, per_decade=1.5, risks={"copd": 4.0, "heart_failure": 4.0, "osa": 2.0}, ages=(30, 130)),
        (R({"I27.22": 0.7, "I27.20": 0.3}, "heart_failure"),
         R({"I27.23": 0.7, "I27.20": 0.3}, "copd"),
         R({"I27.20": 0.7, "I27.29": 0.3})),
        0.6,
        "Classified by cause: left heart disease (I27.22) or lung disease (I27.23).",
    ),
    Chronic(
        "pad", "Peripheral arterial disease",
        H(0.004, per_decade=1.7, risks={"smoker": 3.0, "diabetes": 2.5, "hypertension": 1.4}, ages=(40, 130)),
        (R({"E11.51": 0.8, "I73.9": 0.2}, "t2dm"),
         R({"I70.213": 0.4, "I73.9": 0.4, "I70.211": 0.1, "I70.212": 0.1})),
        0.6,
        "In type 2 diabetes the combination code E11.51 is used; otherwise claudication of the legs.",
        meds=(("", "cilostazol"),),
    ),
    Chronic(
        "smoker", "Current tobacco smoking",
        H(0.03, requires="!former_smoker", ages=(14, 35)),
        (R({"F17.210": 0.8, "Z72.0": 0.2}),),
        0.5,
        "Starts young; quitting moves the patient to former smoker (Z87.891) for good.",
        progression={"present": (None, H(0.04, per_decade=1.3))},
        meds=(("", "nicotine patch"),),
    ),
    Chronic(
        "former_smoker", "Personal history of nicotine dependence",
        None, (R({"Z87.891": 1.0}),), 0.45,
        "Set when a smoker quits; a durable history code.",
    ),
    Chronic(
        "copd", "Chronic obstructive pulmonary disease",
        H(0.0025, per_decade=1.7, risks={"smoker": 6.0, "former_smoker": 3.0}, ages=(40, 130), cap=6.0),
        (R({"J44.9": 0.7, "J43.9": 0.2, "J44.89": 0.1}),),
        0.85,
        "Smoking-related; moderate disease progresses to severe with chronic hypoxic respiratory "
        "failure and home oxygen.",
        stages=("moderate", "severe"),
        initial=(0.85, 0.15),
        progression={"moderate": ("severe", H(0.08, risks={"smoker": 1.5}))},
        also=(extra({"J96.11": 0.7, "J96.10": 0.3}, 0.6, "copd:severe"), extra("Z99.81", 0.6, "copd:severe")),
        meds=(("", "tiotropium"), ("", "albuterol")),
    ),
    Chronic(
        "asthma", "Asthma",
        H(0.0012, per_decade=0.9, female=1.5, risks={"obesity": 1.6}, ages=(5, 130)),
        (R({"J45.909": 0.5, "J45.20": 0.2, "J45.40": 0.2, "J45.50": 0.1}),),
        0.7,
        "Persistent asthma, more frequent in women and in obesity; severity sibling varies by coder.",
        meds=(("", "fluticasone-salmeterol"), ("", "albuterol")),
    ),
    Chronic(
        "osa", "Obstructive sleep apnoea",
        H(0.004, female=0.5, risks={"obesity": 4.0}, ages=(25, 130)),
        (R({"G47.33": 1.0}),), 0.45,
        "Strongly tied to obesity and male sex; raises the risk of AF and pulmonary hypertension.",
    ),
    Chronic(
        "obesity", "Obesity with body-mass-index class",
        H(0.008, per_decade=0.9, ages=(18, 75)),
        (R({"E66.811": 0.5, "E66.9": 0.5}, "obesity:class1"),
         R({"E66.812": 0.5, "E66.9": 0.5}, "obesity:class2"),
         R({"E66.01": 0.5, "E66.813": 0.5}, "obesity:class3")),
        0.45,
        "Obesity class is fixed at onset; the BMI Z68 code is the patient's own (sticky).",
        stages=("class1", "class2", "class3"),
        initial=(0.55, 0.28, 0.17),
        also=(extra({"Z68.30": 1, "Z68.31": 1, "Z68.32": 1, "Z68.33": 1, "Z68.34": 1}, 0.6, "obesity:class1", True),
              extra({"Z68.35": 1, "Z68.36": 1, "Z68.37": 1, "Z68.38": 1, "Z68.39": 1}, 0.6, "obesity:class2", True),
              extra({"Z68.41": 2, "Z68.42": 1.5, "Z68.43": 1, "Z68.44": 0.6, "Z68.45": 0.4}, 0.6, "obesity:class3",
                    True)),
    ),
    Chronic(
        "hypothyroidism", "Hypothyroidism",
        H(0.003, per_decade=1.3, female=4.0, ages=(20, 130)),
        (R({"E03.9": 0.9, "E03.8": 0.1}),), 0.6,
        "Common in older women; consistently coded because levothyroxine appears on every med list.",
        meds=(("", "levothyroxine"),),
    ),
    Chronic(
        "gerd", "Gastro-oesophageal reflux disease",
        H(0.008, per_decade=1.2, risks={"obesity": 1.6}, ages=(20, 130)),
        (R({"K21.9": 0.85, "K21.00": 0.15}),), 0.4,
        "Frequent, inconsistently coded background condition.",
        meds=(("", "pantoprazole"),),
    ),
    Chronic(
        "depression", "Major depressive disorder",
        H(0.0025, per_decade=0.95, female=1.7, risks={"heart_failure": 1.4, "copd": 1.4, "active_cancer": 1.8,
                                                   "alcohol_use": 2.0}, ages=(15, 130)),
        (R({"F32.A": 0.45, "F32.9": 0.25, "F33.1": 0.15, "F33.0": 0.1, "F32.1": 0.05}),), 0.45,
        "Coded with many near-synonymous siblings (F32.A vs F32.9, single vs recurrent episode).",
        meds=(("", "sertraline"),),
    ),
    Chronic(
        "anxiety", "Anxiety disorder",
        H(0.003, per_decade=0.85, female=1.6, ages=(15, 130)),
        (R({"F41.9": 0.7, "F41.1": 0.3}),), 0.35,
        "Background mental-health condition, often omitted.",
    ),
    Chronic(
        "serious_mental_illness", "Schizophrenia spectrum or bipolar disorder",
        H(0.0012, per_decade=0.6, ages=(16, 70)),
        (R({"F20.9": 0.35, "F31.9": 0.45, "F25.9": 0.2}, sticky=True),), 0.85,
        "The diagnosis is stable for a patient (sticky) and almost always coded.",
        meds=(("", "olanzapine"),),
    ),
    Chronic(
        "alcohol_use", "Alcohol use disorder",
        H(0.0012, per_decade=0.8, female=0.4, risks={"smoker": 2.0, "depression": 1.5}, ages=(18, 80)),
        (R({"F10.20": 0.55, "F10.10": 0.3, "F10.21": 0.15}),), 0.7,
        "Dependence drives withdrawal admissions, pancreatitis and cirrhosis.",
        meds=(("", "thiamine"),),
    ),
    Chronic(
        "cirrhosis", "Cirrhosis of the liver",
        H(0.0007, per_decade=1.2, risks={"alcohol_use": 15.0, "obesity": 1.6, "t2dm": 1.5}, ages=(30, 130), cap=20.0),
        (R({"K70.30": 0.8, "K74.60": 0.2}, "alcohol_use"), R({"K74.60": 0.6, "K74.69": 0.4})),
        0.85,
        "Alcoholic cirrhosis (K70.3x) when alcohol use disorder is present, else unspecified "
        "cirrhosis; decompensates with ascites, encephalopathy and variceal bleeding.",
        meds=(("", "spironolactone"), ("", "lactulose")),
    ),
    Chronic(
        "osteoarthritis", "Osteoarthritis of knee or hip",
        H(0.006, per_decade=1.6, female=1.4, risks={"obesity": 2.0}, ages=(40, 130)),
        (R({"M17.11": 0.8, "M17.9": 0.2}, "osteoarthritis:knee_right"),
         R({"M17.12": 0.8, "M17.9": 0.2}, "osteoarthritis:knee_left"),
         R({"M16.11": 0.8, "M16.9": 0.2}, "osteoarthritis:hip_right"),
         R({"M16.12": 0.8, "M16.9": 0.2}, "osteoarthritis:hip_left"),
         R({"M17.0": 0.8, "M17.9": 0.2}, "osteoarthritis:knee_bilateral")),
        0.35,
        "The affected joint is fixed at onset and decides which arthroplasty follows.",
        stages=("knee_right", "knee_left", "hip_right", "hip_left", "knee_bilateral"),
        initial=(0.25, 0.25, 0.15, 0.15, 0.2),
    ),
    Chronic(
        "joint_replacement", "Presence of artificial knee or hip joint", None,
        (R({"Z96.651": 1.0}, "joint_replacement:knee_right"), R({"Z96.652": 1.0}, "joint_replacement:knee_left"),
         R({"Z96.641": 1.0}, "joint_replacement:hip_right"), R({"Z96.642": 1.0}, "joint_replacement:hip_left"),
         R({"Z96.653": 1.0}, "joint_replacement:knee_bilateral")),
        0.55,
        "Set by arthroplasty (elective or after a hip fracture) on the same joint and side.",
        stages=("knee_right", "knee_left", "hip_right", "hip_left", "knee_bilateral"),
    ),
    Chronic(
        "osteoporosis", "Osteoporosis",
        H(0.003, per_decade=2.0, female=4.0, ages=(45, 130)),
        (R({"M81.0": 0.9, "M81.8": 0.1}),), 0.5,
        "Postmenopausal bone loss; multiplies hip-fracture risk.",
        meds=(("", "alendronate"),),
    ),
    Chronic(
        "gout", "Gout",
        H(0.002, per_decade=1.4, female=0.35, risks={"ckd": 2.0, "obesity": 1.6, "heart_failure": 1.5}, ages=(30, 130)),
        (R({"M10.9": 0.6, "M1A.9XX0": 0.4}),), 0.5,
        "Hyperuricaemia of men, CKD and diuretic use.",
        meds=(("", "allopurinol"),),
    ),
    Chronic(
        "chronic_back_pain", "Chronic low back pain",
        H(0.008, per_decade=1.1, risks={"obesity": 1.5}, ages=(25, 130)),
        (R({"M54.50": 0.45, "M54.59": 0.2, "M51.16": 0.2, "G89.29": 0.15}),), 0.3,
        "Frequent background complaint with several coding conventions.",
        meds=(("", "acetaminophen"),),
    ),
    Chronic(
        "bph", "Benign prostatic hyperplasia",
        H(0.01, per_decade=2.0, female=0.0, ages=(45, 130)),
        (R({"N40.0": 0.55, "N40.1": 0.45}),), 0.5,
        "Men only; urinary symptoms predispose to retention and urinary infection.",
        meds=(("", "tamsulosin"),),
    ),
    Chronic(
        "dementia", "Dementia",
        H(0.001, per_decade=3.2, risks={"hypertension": 1.3, "t2dm": 1.4, "stroke_history": 2.0, "parkinson": 3.0},
          ages=(55, 130)),
        (R({"F03.90": 0.5, "G30.9": 0.3, "F01.50": 0.2}, sticky=True),), 0.85,
        "Type (unspecified, Alzheimer, vascular) is fixed per patient; Alzheimer's disease is "
        "coded with its manifestation F02.80.",
        also=(extra("F02.80", 0.9, "dementia_alzheimer"),),
        meds=(("", "donepezil"),),
    ),
    Chronic(
        "parkinson", "Parkinson's disease",
        H(0.0008, per_decade=2.5, female=0.6, ages=(45, 130)),
        (R({"G20.A1": 0.85, "G20.C": 0.15}),), 0.9,
        "Raises the risk of falls, aspiration pneumonia and dementia.",
        meds=(("", "carbidopa-levodopa"),),
    ),
    Chronic(
        "epilepsy", "Epilepsy",
        H(0.0008, per_decade=1.1, ages=(5, 130), risks={"stroke_history": 4.0}),
        (R({"G40.909": 0.7, "G40.919": 0.15, "G40.209": 0.15}),), 0.85,
        "Seizure disorder (including post-stroke epilepsy); breakthrough seizures cause admissions.",
        meds=(("", "levetiracetam"),),
    ),
    Chronic(
        "stroke_history", "History of cerebral infarction", None,
        (R({"Z86.73": 0.55, "I69.351": 0.2, "I69.320": 0.15, "I69.354": 0.1}, sticky=True),), 0.7,
        "Set by a stroke: without residual deficit Z86.73, or a sequela code kept per patient.",
    ),
    Chronic(
        "vte_history", "Personal history of venous thromboembolism", None,
        (R({"Z86.718": 0.6, "Z86.711": 0.4}, sticky=True),), 0.6,
        "Set by a deep-vein thrombosis or pulmonary embolism; the indication for anticoagulation.",
    ),
    Chronic(
        "iron_deficiency", "Iron-deficiency anaemia",
        H(0.003, female=2.0, risks={"ckd": 1.5, "gerd": 1.3, "anticoagulation": 1.5}, ages=(18, 130)),
        (R({"D50.9": 0.75, "D50.0": 0.25}),), 0.55,
        "Chronic blood loss and poor intake; keeps haemoglobin low.",
        meds=(("", "ferrous sulfate"),),
    ),
    Chronic(
        "hip_fracture_recovery", "Recovery after a hip fracture",
        None,
        (R({"S72.001D": 0.7, "Z47.89": 0.3}, "hip_fracture_recovery:right"),
         R({"S72.002D": 0.7, "Z47.89": 0.3}, "hip_fracture_recovery:left")),
        0.6,
        "The months after a hip fracture: subsequent-encounter fracture codes and aftercare.",
        stages=("right", "left"),
        progression={"right": (None, H(2.0)), "left": (None, H(2.0))},
    ),
    Chronic(
        "prior_cesarean", "Previous caesarean delivery", None,
        (), 0.0,
        "Set by a caesarean delivery; a marker coded only during a later pregnancy (O34.21x, see pregnancy).",
    ),
    # -- pregnancy and its complications (transient: they end with the pregnancy) --------------
    Chronic(
        "pregnancy", "Pregnancy",
        H(0.005, per_decade=0.5, risks={"male": 0.0}, ages=(18, 44)),
        (R({"Z3A.{week}": 1.0}, "obstetric"), R({"Z33.1": 1.0}, "!obstetric")),
        0.95,
        "Gestational age is tracked from conception; obstetric stays carry the weeks-of-gestation "
        "code Z3A.xx, other stays the incidental pregnant-state code; labour comes at term "
        "(scheduled) and the delivery ends the pregnancy.",
        also=(extra({"O34.211": 0.7, "O34.219": 0.3}, 0.85, "prior_cesarean obstetric"),
              extra({"O99.213": 1.0}, 0.5, "obesity obstetric !reason:delivery_vaginal !reason:delivery_cesarean"),
              extra({"O99.214": 1.0}, 0.6, "obesity reason:delivery_vaginal"),
              extra({"O99.214": 1.0}, 0.6, "obesity reason:delivery_cesarean"),
              extra({"O99.334": 1.0}, 0.7, "smoker reason:delivery_vaginal"),
              extra({"O99.334": 1.0}, 0.7, "smoker reason:delivery_cesarean"),
              extra({"O99.333": 1.0}, 0.6, "smoker obstetric pregnancy:t3")),
        meds=(("", "prenatal vitamins"),),
    ),
    Chronic(
        "gestational_diabetes", "Gestational diabetes",
        H(0.12, risks={"obesity": 3.0, "age40": 1.5}, requires="pregnancy"),
        (R({"O24.420": 0.7, "O24.424": 0.3}, "reason:delivery_vaginal"),
         R({"O24.420": 0.7, "O24.424": 0.3}, "reason:delivery_cesarean"),
         R({"O24.410": 0.6, "O24.414": 0.3, "O24.419": 0.1})),
        0.9,
        "Develops in the second half of pregnancy; antepartum O24.41x, at delivery O24.42x.",
        transient=True,
    ),
    Chronic(
        "gestational_hypertension", "Gestational hypertension or pre-eclampsia",
        H(0.1, risks={"obesity": 2.0, "hypertension": 3.0, "age40": 1.5}, requires="pregnancy"),
        (R({"O14.04": 0.5, "O13.4": 0.5}, "reason:delivery_vaginal"),
         R({"O14.04": 0.5, "O14.14": 0.2, "O13.4": 0.3}, "reason:delivery_cesarean"),
         R({"O13.3": 0.6, "O14.03": 0.4}, "pregnancy:t3"),
         R({"O13.2": 1.0})),
        0.95,
        "Pregnancy-induced hypertension coded by trimester (O13.2/O13.3) or as pre-eclampsia, and "
        "at delivery as complicating childbirth.",
        transient=True,
    ),
    # -- cancers (factory below adds one per site) ---------------------------------------------
)


def _cancer(name: str, title: str, onset: Hazard, primary: dict[str, float], history: str,
            surgery: tuple[Procedure, ...], regimen: tuple[str, ...], reasoning: str) -> tuple[Chronic, Reason]:
    """A cancer site: latent onset → work-up/surgery → chemotherapy → remission or metastasis."""
    chronic = Chronic(
        name, title, onset,
        (R({history: 1.0}, f"{name}:remission"), R(primary, sticky=True)),
        0.9,
        reasoning + " The primary site code is fixed per patient; remission is coded as personal history.",
        stages=("new", "treatment", "metastatic", "remission"),
        progression={"treatment": ("remission", H(1.1)), "remission": ("metastatic", H(0.04)),
                     "metastatic": (None, H(0.0))},
        also=(extra({"C78.7": 0.4, "C79.51": 0.4, "C78.00": 0.2}, 0.9, f"{name}:metastatic", True),
              extra("Z92.21", 0.4, f"{name}:remission")),
        meds=((f"{name}:metastatic", "oxycodone"),) + tuple((f"{name}:treatment", agent) for agent in regimen),
    )
    workup = Reason(
        f"{name}_diagnosis", f"Diagnosis and resection of {title.lower()}",
        H(4.0, requires=f"{name}:new"),
        (R(primary, sticky=True),),
        "A new cancer leads to a diagnostic admission with resection, after which chemotherapy starts.",
        admission="ELECTIVE", tags=("surgery", "oncology"), covers=(name,), procedures=surgery,
        los_days=5.0, mortality=0.01, sets={name: "treatment"},
        plan="oncology clinic to start adjuvant chemotherapy",
    )
    return chronic, workup


_CANCERS = (
    _cancer("breast_cancer", "Breast cancer", H(0.0025, per_decade=1.3, female=1.0, risks={"male": 0.01},
                                                ages=(30, 130)),
            {"C50.911": 0.4, "C50.912": 0.4, "C50.411": 0.1, "C50.412": 0.1}, "Z85.3",
            (Procedure("0HTT0ZZ", 0.25), Procedure("0HTU0ZZ", 0.25), Procedure("0HBT0ZZ", 0.3)),
            ("doxorubicin", "cyclophosphamide", "paclitaxel"),
            "Commonest cancer of women; anthracycline/taxane adjuvant chemotherapy."),
    _cancer("lung_cancer", "Lung cancer", H(0.0003, per_decade=1.8, risks={"smoker": 8.0, "former_smoker": 4.0,
                                                                          "copd": 2.0}, ages=(40, 130), cap=12.0),
            {"C34.11": 0.3, "C34.12": 0.25, "C34.31": 0.15, "C34.32": 0.1, "C34.90": 0.2}, "Z85.118",
            (Procedure("0BTC4ZZ", 0.4), Procedure("0BTG4ZZ", 0.3)),
            ("carboplatin", "pemetrexed"),
            "Driven by smoking; metastasizes early; platinum doublet chemotherapy."),
    _cancer("colorectal_cancer", "Colorectal cancer", H(0.0012, per_decade=1.7, risks={"obesity": 1.4,
                                                                                    "smoker": 1.3}, ages=(40, 130)),
            {"C18.7": 0.3, "C18.2": 0.2, "C18.9": 0.2, "C20": 0.3}, "Z85.038",
            (Procedure("0DTN0ZZ", 0.5), Procedure("0DTP0ZZ", 0.3), Procedure("0DJD8ZZ", 0.8)),
            ("oxaliplatin", "fluorouracil", "leucovorin"),
            "Sigmoid, ascending colon or rectum; resected then adjuvant FOLFOX chemotherapy."),
    _cancer("prostate_cancer", "Prostate cancer", H(0.0015, per_decade=2.2, female=0.0, ages=(45, 130)),
            {"C61": 1.0}, "Z85.46",
            (Procedure("0VT04ZZ", 0.6),),
            ("docetaxel", "leuprolide"),
            "Men only; prostatectomy then docetaxel with androgen deprivation in this model."),
)
CHRONIC = CHRONIC + tuple(c for c, _ in _CANCERS)
CANCER_NAMES = tuple(c.name for c, _ in _CANCERS)

# ---------------------------------------------------------------------------------------------
# Encounter reasons: they compete (reason k has probability λ_k / Σλ at an encounter)
# ---------------------------------------------------------------------------------------------
REASONS: tuple[Reason, ...] = (
    Reason(
        "pneumonia", "Pneumonia",
        H(0.012, per_decade=1.6, risks={"copd": 3.0, "heart_failure": 1.6, "dementia": 2.5, "chemo": 2.0,
                                        "smoker": 1.5, "asthma": 1.5, "parkinson": 2.0, "ckd": 1.3}),
        (R({"J69.0": 1.0}, "aspiration_risk"),
         R({"J18.9": 0.55, "J18.1": 0.1, "J15.9": 0.1, "J13": 0.08, "J15.1": 0.05, "J15.212": 0.04,
            "J15.211": 0.04, "J15.69": 0.04})),
        "Community-acquired pneumonia, aspiration pneumonia in dementia or Parkinson's disease; "
        "the organism is usually unknown (J18.9).",
        tags=("infection", "respiratory"),
        secondary=(extra({"J96.01": 0.8, "R09.02": 0.2}, 0.25), extra({"J96.21": 1.0}, 0.3, "copd:severe"),
                   extra("E86.0", 0.15), extra("J90", 0.08)),
        meds=("ceftriaxone", "azithromycin"), los_days=4.5, mortality=0.03, plan="complete oral antibiotics",
    ),
    Reason(
        "covid19", "COVID-19",
        H(0.01, per_decade=1.7, risks={"obesity": 1.5, "t2dm": 1.5, "copd": 1.5, "heart_failure": 1.5},
          requires="covid_era"),
        (R({"U07.1": 1.0}),),
        "SARS-CoV-2 infection from March 2020; pneumonia is coded as J12.82 alongside U07.1.",
        tags=("infection", "respiratory"),
        secondary=(extra("J12.82", 0.6), extra({"J96.01": 1.0}, 0.3)),
        meds=("dexamethasone", "remdesivir"), los_days=5.0, mortality=0.06, plan="home isolation, pulse oximetry",
    ),
    Reason(
        "uti", "Urinary tract infection",
        H(0.008, per_decade=1.6, female=2.2, risks={"dementia": 2.5, "t2dm": 1.4, "bph": 2.0, "ckd": 1.3,
                                                    "diabetes": 1.2}),
        (R({"N39.0": 0.85, "N10": 0.15}),),
        "Cystitis or pyelonephritis, frequent in women, dementia and prostatic obstruction; the "
        "organism is often documented.",
        tags=("infection",),
        secondary=(extra({"B96.20": 0.6, "B96.1": 0.15, "B95.2": 0.15, "B96.4": 0.1}, 0.55), extra("E86.0", 0.2)),
        meds=("ceftriaxone",), los_days=3.5, mortality=0.01, plan="oral antibiotics for 7 days",
    ),
    Reason(
        "sepsis", "Sepsis",
        H(0.006, per_decade=1.7, risks={"chemo": 4.0, "ckd": 1.5, "diabetes": 1.5, "dementia": 2.0,
                                        "cirrhosis": 2.5, "dialysis": 2.5}),
        (R({"A41.9": 0.55, "A41.51": 0.2, "A41.01": 0.1, "A41.02": 0.05, "A41.89": 0.1}),),
        "Sepsis is sequenced first with its source (urinary, pulmonary, skin) and severity codes.",
        tags=("infection", "critical"),
        secondary=(extra({"R65.20": 0.7, "R65.21": 0.3}, 0.5),
                   extra({"N39.0": 0.5, "J18.9": 0.35, "L03.90": 0.15}, 0.85)),
        procedures=(Procedure("02HV33Z", 0.3), Procedure("5A1935Z", 0.08)),
        meds=("vancomycin", "piperacillin-tazobactam", "norepinephrine"), los_days=7.0, mortality=0.12,
        plan="complete antibiotics, repeat blood cultures",
    ),
    Reason(
        "cellulitis", "Cellulitis",
        H(0.006, per_decade=1.2, risks={"t2dm": 2.0, "obesity": 2.2, "pad": 1.5, "heart_failure": 1.3}),
        (R({"L03.115": 0.3, "L03.116": 0.3, "L03.119": 0.1, "L03.113": 0.08, "L03.114": 0.08, "L03.311": 0.07,
            "L03.317": 0.07}),),
        "Skin infection of the legs in diabetes, obesity and oedema; the site differs each time.",
        tags=("infection",),
        secondary=(extra({"L02.415": 0.5, "L02.416": 0.5}, 0.15), extra({"B95.61": 0.5, "B95.62": 0.5}, 0.15)),
        meds=("cefazolin",), los_days=3.5, plan="elevate limb, oral antibiotics",
    ),
    Reason(
        "diabetic_foot", "Diabetic foot ulcer and osteomyelitis",
        H(0.05, risks={"pad": 2.0, "hba1c_high": 1.6}, requires="diabetes diabetic_neuropathy"),
        (R({"E11.621": 1.0}, "t2dm"), R({"E10.621": 1.0})),
        "Neuropathic and ischaemic ulcers; the ulcer site/depth and osteomyelitis are coded too.",
        tags=("infection",),
        secondary=(extra({"L97.519": 0.3, "L97.529": 0.3, "L97.419": 0.2, "L97.429": 0.2}, 0.9),
                   extra({"M86.171": 0.5, "M86.172": 0.5}, 0.3)),
        procedures=(Procedure("0Y6N0Z0", 0.1),), meds=("vancomycin",), los_days=6.0,
        plan="wound care clinic, offloading",
    ),
    Reason(
        "hf_exacerbation", "Acute on chronic heart failure",
        H(0.12, risks={"ckd": 1.3, "atrial_fibrillation": 1.2, "valvular_disease": 1.3}, requires="heart_failure"),
        (R({"I50.23": 0.7, "I50.21": 0.15, "I50.9": 0.15}, "heart_failure:hfref"),
         R({"I50.33": 0.7, "I50.31": 0.15, "I50.9": 0.15}, "heart_failure:hfpef"),
         R({"I50.43": 0.75, "I50.41": 0.1, "I50.9": 0.15})),
        "Decompensation of known heart failure; the acute-on-chronic code of the patient's subtype "
        "replaces the chronic one.",
        tags=("cardiac",), covers=("heart_failure",),
        secondary=(extra({"J96.01": 1.0}, 0.15), extra("I50.810", 0.05), extra("R79.89", 0.1)),
        meds=("furosemide",), los_days=4.5, mortality=0.03, plan="daily weights, diuretic titration in clinic",
    ),
    Reason(
        "copd_exacerbation", "COPD exacerbation",
        H(0.1, risks={"copd:severe": 2.0, "smoker": 1.3}, requires="copd"),
        (R({"J44.1": 0.8, "J44.0": 0.2}),),
        "Acute exacerbation (J44.1) or with lower respiratory infection (J44.0); respiratory "
        "failure is added when hypoxic or hypercapnic.",
        tags=("respiratory",), covers=("copd",),
        secondary=(extra({"J96.21": 0.6, "J96.22": 0.4}, 0.45, "copd:severe"),
                   extra({"J96.01": 0.7, "J96.02": 0.3}, 0.12, "!copd:severe"),
                   extra("J20.9", 0.5, "")),
        procedures=(Procedure("5A09357", 0.2),),
        meds=("prednisone", "ipratropium-albuterol", "azithromycin"), los_days=4.0, mortality=0.02,
        plan="steroid taper, pulmonary rehabilitation referral",
    ),
    Reason(
        "asthma_exacerbation", "Asthma exacerbation",
        H(0.07, per_decade=0.8, requires="asthma"),
        (R({"J45.901": 0.5, "J45.41": 0.3, "J45.51": 0.2}),),
        "Status or acute exacerbation coded with the persistence class.",
        tags=("respiratory",), covers=("asthma",), meds=("prednisone", "albuterol"), los_days=2.5,
        plan="inhaled steroid adherence, asthma action plan",
    ),
    Reason(
        "ami", "Acute myocardial infarction",
        H(0.0025, per_decade=1.5, female=0.5, risks={"cad": 3.0, "diabetes": 1.5, "smoker": 1.6, "hyperlipidemia": 1.2,
                                                    "hypertension": 1.2, "ckd": 1.3, "old_mi": 1.5}),
        (R({"I21.4": 0.6, "I21.09": 0.12, "I21.19": 0.12, "I21.3": 0.06, "I21.A1": 0.1}),),
        "NSTEMI dominates; STEMI by territory; type 2 MI from supply–demand mismatch. Leaves CAD and "
        "old-MI status behind; half get a drug-eluting stent.",
        tags=("cardiac",), procedures=(Procedure("4A023N7", 0.8), Procedure("B2111ZZ", 0.8), Procedure("027034Z", 0.5)),
        meds=("aspirin", "ticagrelor", "atorvastatin", "metoprolol", "heparin"), los_days=3.5, mortality=0.06,
        sets={"cad": "present", "old_mi": "present"}, plan="cardiac rehabilitation, dual antiplatelet therapy",
    ),
    Reason(
        "chest_pain", "Chest pain, acute coronary syndrome ruled out",
        H(0.008, per_decade=1.1, risks={"cad": 2.0, "anxiety": 1.5, "gerd": 1.3}),
        (R({"I20.0": 0.7, "R07.9": 0.3}, "cad"), R({"R07.9": 0.5, "R07.89": 0.3, "R07.2": 0.2})),
        "Observation stays for chest pain; unstable angina in known coronary disease.",
        admission="OBSERVATION", tags=("cardiac",), procedures=(Procedure("4A023N7", 0.2),),
        meds=("aspirin", "nitroglycerin"), los_days=1.2, plan="outpatient stress test",
    ),
    Reason(
        "cabg", "Elective coronary artery bypass grafting",
        H(0.04, risks={"old_mi": 3.0, "diabetes": 1.5}, requires="cad !cabg_status", ages=(40, 85)),
        (R({"I25.10": 0.8, "I25.110": 0.2}),),
        "Multivessel coronary disease, especially after an infarction or with diabetes, is "
        "revascularised surgically; CABG status follows.",
        admission="ELECTIVE", tags=("cardiac", "surgery"), covers=("cad",),
        secondary=(extra("D62", 0.35), extra("I97.89", 0.1), extra("I48.91", 0.2, "!atrial_fibrillation")),
        procedures=(Procedure("02100Z9", 0.95), Procedure("021109W", 0.7), Procedure("30233N1", 0.35),
                    Procedure("5A1221Z", 0.95)),
        meds=("aspirin", "atorvastatin", "metoprolol"), los_days=7.0, mortality=0.02,
        sets={"cabg_status": "present"}, plan="cardiac surgery clinic, sternal precautions",
    ),
    Reason(
        "af_rvr", "Atrial fibrillation with rapid ventricular response",
        H(0.1, risks={"heart_failure": 1.3}, requires="atrial_fibrillation"),
        (R({"I48.91": 0.5, "I48.0": 0.3, "I48.19": 0.2}),),
        "Rate-control admissions for known AF; some are cardioverted.",
        tags=("cardiac",), covers=("atrial_fibrillation",), procedures=(Procedure("5A2204Z", 0.2),),
        meds=("diltiazem", "metoprolol"), los_days=2.5, plan="rate control, anticoagulation review",
    ),
    Reason(
        "bradycardia", "Symptomatic bradycardia requiring pacemaker",
        H(0.002, per_decade=2.2, requires="!pacemaker", ages=(50, 130)),
        (R({"I49.5": 0.5, "I44.2": 0.3, "I44.1": 0.2}),),
        "Sick sinus syndrome or high-grade AV block treated with a dual-chamber pacemaker.",
        tags=("cardiac",), procedures=(Procedure("0JH606Z", 0.9), Procedure("02H63JZ", 0.9), Procedure("02HK3JZ", 0.9)),
        los_days=2.0, sets={"pacemaker": "present"}, plan="device clinic in two weeks",
    ),
    Reason(
        "stroke", "Acute ischaemic or haemorrhagic stroke",
        H(0.002, per_decade=1.9, risks={"atrial_fibrillation": 4.0, "anticoagulation": 0.4, "hypertension": 1.8,
                                        "diabetes": 1.6, "smoker": 1.8, "stroke_history": 2.0}),
        (R({"I63.9": 0.3, "I63.512": 0.2, "I63.511": 0.15, "I63.412": 0.1, "I63.411": 0.1, "I61.9": 0.15}),),
        "Cerebral infarction by territory or intracerebral haemorrhage with its deficits and NIH "
        "stroke scale; leaves a history of stroke.",
        tags=("neuro",),
        secondary=(extra({"G81.91": 0.55, "G81.94": 0.45}, 0.35), extra("R47.01", 0.3), extra("R13.10", 0.25),
                   extra({"R29.701": 1, "R29.703": 1, "R29.705": 1, "R29.708": 1, "R29.712": 1, "R29.718": 1}, 0.5)),
        procedures=(Procedure("3E03317", 0.15), Procedure("03CG3ZZ", 0.08), Procedure("B020ZZZ", 0.9)),
        meds=("aspirin", "atorvastatin"), los_days=5.5, mortality=0.1,
        sets={"stroke_history": "present"}, plan="stroke rehabilitation, secondary prevention",
    ),
    Reason(
        "tia", "Transient ischaemic attack",
        H(0.002, per_decade=1.8, risks={"atrial_fibrillation": 2.0, "hypertension": 1.6, "cad": 1.5}),
        (R({"G45.9": 1.0}),),
        "Brief deficit with full recovery; observation and vascular work-up.",
        admission="OBSERVATION", tags=("neuro",), meds=("aspirin", "clopidogrel"), los_days=1.5,
        plan="carotid imaging results with neurology",
    ),
    Reason(
        "seizure", "Breakthrough seizure",
        H(0.15, requires="epilepsy"),
        (R({"G40.909": 0.6, "G40.919": 0.4}),),
        "Admission for seizures in known epilepsy.",
        tags=("neuro",), covers=("epilepsy",), meds=("levetiracetam", "lorazepam"), los_days=2.0,
        plan="anti-seizure medication levels, driving advice",
    ),
    Reason(
        "gi_bleed", "Gastrointestinal haemorrhage",
        H(0.003, per_decade=1.6, risks={"anticoagulation": 2.5, "cirrhosis": 3.0, "ckd": 1.5, "alcohol_use": 2.0}),
        (R({"I85.11": 0.5, "K92.2": 0.5}, "cirrhosis"),
         R({"K92.2": 0.3, "K92.1": 0.2, "K25.4": 0.12, "K26.4": 0.12, "K57.31": 0.16, "K62.5": 0.1})),
        "Upper or lower GI bleeding, variceal in cirrhosis, anticoagulant-associated; acute blood "
        "loss anaemia and transfusion are common.",
        tags=("gi",),
        secondary=(extra("D62", 0.6), extra("T45.515A", 0.5, "anticoagulation")),
        procedures=(Procedure("0DJ08ZZ", 0.6), Procedure("0DJD8ZZ", 0.3), Procedure("30233N1", 0.5)),
        meds=("pantoprazole", "octreotide"), los_days=4.0, mortality=0.03, plan="repeat haemoglobin in one week",
    ),
    Reason(
        "hip_fracture_right", "Fracture of the right hip after a fall",
        H(0.0008, per_decade=2.6, female=1.8, risks={"osteoporosis": 2.5, "dementia": 2.0, "parkinson": 2.5},
          ages=(50, 130)),
        (R({"S72.001A": 0.6, "S72.141A": 0.4}),),
        "Falls of the frail elderly; fixation or hemiarthroplasty, then months of aftercare.",
        tags=("injury", "surgery"),
        secondary=(extra({"W19.XXXA": 0.5, "W18.30XA": 0.3, "W01.0XXA": 0.2}, 0.8), extra("Y92.009", 0.4),
                   extra("D62", 0.3),
                   extra("R26.81", 0.2)),
        procedures=(Procedure("0QS634Z", 0.6), Procedure("0SR90J9", 0.35)),
        meds=("enoxaparin", "oxycodone"), los_days=6.0, mortality=0.04,
        sets={"hip_fracture_recovery": "right"}, plan="physical therapy, osteoporosis treatment",
    ),
    Reason(
        "hip_fracture_left", "Fracture of the left hip after a fall",
        H(0.0008, per_decade=2.6, female=1.8, risks={"osteoporosis": 2.5, "dementia": 2.0, "parkinson": 2.5},
          ages=(50, 130)),
        (R({"S72.002A": 0.6, "S72.142A": 0.4}),),
        "Mirror image of the right hip fracture.",
        tags=("injury", "surgery"),
        secondary=(extra({"W19.XXXA": 0.5, "W18.30XA": 0.3, "W01.0XXA": 0.2}, 0.8), extra("Y92.009", 0.4),
                   extra("D62", 0.3),
                   extra("R26.81", 0.2)),
        procedures=(Procedure("0QS734Z", 0.6), Procedure("0SRB0J9", 0.35)),
        meds=("enoxaparin", "oxycodone"), los_days=6.0, mortality=0.04,
        sets={"hip_fracture_recovery": "left"}, plan="physical therapy, osteoporosis treatment",
    ),
    Reason(
        "fall_injury", "Other injury from a fall",
        H(0.002, per_decade=1.8, risks={"dementia": 2.0, "parkinson": 2.0, "alcohol_use": 2.0}),
        (R({"S06.0X0A": 0.25, "S06.0X1A": 0.1, "S22.31XA": 0.15, "S22.32XA": 0.15, "S32.010A": 0.1,
            "S42.201A": 0.1, "S52.501A": 0.15}),),
        "Head injury, rib, vertebral, humerus or wrist fracture after a fall: one-off events.",
        tags=("injury",), secondary=(extra({"W19.XXXA": 0.6, "W18.30XA": 0.4}, 0.8), extra("Y92.009", 0.3)),
        meds=("acetaminophen",), los_days=2.5, plan="fall-risk assessment",
    ),
    Reason(
        "traffic_injury", "Motor-vehicle collision injury",
        H(0.0015, per_decade=0.7, female=0.6, risks={"alcohol_use": 2.5}, ages=(16, 130)),
        (R({"S06.0X1A": 0.2, "S22.41XA": 0.15, "S36.116A": 0.1, "S82.201A": 0.15, "S72.301A": 0.1, "S32.810A": 0.1,
            "S27.0XXA": 0.2}),),
        "Young adults, more often men; a one-off multi-trauma admission.",
        tags=("injury",), secondary=(extra({"V43.52XA": 0.6, "V47.5XXA": 0.4}, 0.8),),
        procedures=(Procedure("0W9930Z", 0.15),), meds=("oxycodone",), los_days=4.0, mortality=0.02,
        plan="trauma clinic follow-up",
    ),
    Reason(
        "vte", "Venous thromboembolism",
        H(0.0015, per_decade=1.5, risks={"active_cancer": 4.0, "hip_fracture_recovery": 3.0, "obesity": 1.6,
                                         "pregnancy": 3.0, "anticoagulation": 0.2}),
        (R({"I26.99": 0.3, "I26.92": 0.05, "I26.09": 0.05, "I82.401": 0.15, "I82.402": 0.15, "I82.411": 0.15,
            "I82.412": 0.15}),),
        "Pulmonary embolism or leg DVT, provoked by cancer, surgery, immobility or pregnancy; leaves "
        "a history code and long-term anticoagulation.",
        tags=("vascular",), meds=("heparin", "apixaban"), los_days=3.5, mortality=0.02,
        sets={"vte_history": "present"}, plan="anticoagulation for at least three months",
    ),
    Reason(
        "dka", "Diabetic ketoacidosis",
        H(0.06, per_decade=0.8, risks={"hba1c_high": 2.5}, requires="t1dm"),
        (R({"E10.10": 0.9, "E10.11": 0.1}),),
        "Insulin omission or infection in type 1 diabetes.",
        tags=("metabolic",), covers=("t1dm",), meds=("insulin regular", "potassium chloride"), los_days=3.0,
        plan="diabetes educator, sick-day rules",
    ),
    Reason(
        "hypoglycemia", "Hypoglycaemia on insulin or sulfonylurea",
        H(0.035, per_decade=1.4, risks={"ckd": 1.8, "dementia": 1.6}, requires="insulin_use"),
        (R({"E10.649": 1.0}, "t1dm"), R({"E11.649": 1.0})),
        "Insulin-treated diabetes with declining renal clearance; adverse effect code of insulin.",
        tags=("metabolic",), covers=("t2dm", "t1dm"), secondary=(extra("T38.3X5A", 0.5),),
        meds=("dextrose",), los_days=2.0, plan="reduce insulin dose",
    ),
    Reason(
        "hyperglycemic_crisis", "Hyperosmolar hyperglycaemic state",
        H(0.02, per_decade=1.4, risks={"hba1c_high": 3.0, "dementia": 2.0}, requires="t2dm"),
        (R({"E11.00": 0.5, "E11.65": 0.5}),),
        "Severe hyperglycaemia with dehydration in type 2 diabetes.",
        tags=("metabolic",), covers=("t2dm",), secondary=(extra("E86.0", 0.6),),
        meds=("insulin regular",), los_days=3.5, plan="intensify glucose-lowering therapy",
    ),
    Reason(
        "syncope", "Syncope",
        H(0.003, per_decade=1.6, risks={"atrial_fibrillation": 1.5, "valvular_disease": 2.0, "parkinson": 2.0}),
        (R({"R55": 1.0}),),
        "Observation for syncope, often orthostatic in the elderly.",
        admission="OBSERVATION", secondary=(extra("I95.1", 0.3),), los_days=1.5, plan="ambulatory ECG monitor",
    ),
    Reason(
        "pancreatitis", "Acute pancreatitis",
        H(0.0008, risks={"alcohol_use": 8.0, "obesity": 1.5}, cap=8.0),
        (R({"K85.20": 1.0}, "alcohol_use"), R({"K85.90": 0.5, "K85.10": 0.5})),
        "Alcohol-induced or biliary acute pancreatitis.",
        tags=("gi",), meds=("hydromorphone",), los_days=4.5, mortality=0.01,
        plan="abstinence, lipid and gallstone work-up",
    ),
    Reason(
        "cholecystitis", "Acute calculous cholecystitis",
        H(0.0015, per_decade=1.3, female=2.0, risks={"obesity": 2.0}, ages=(20, 130)),
        (R({"K80.00": 0.7, "K80.10": 0.1, "K81.0": 0.2}),),
        "Gallstone disease treated with laparoscopic cholecystectomy: a one-off event.",
        tags=("gi", "surgery"), procedures=(Procedure("0FT44ZZ", 0.85),), meds=("piperacillin-tazobactam",),
        los_days=2.5, plan="surgical clinic in two weeks",
    ),
    Reason(
        "appendicitis", "Acute appendicitis",
        H(0.0012, per_decade=0.6, ages=(10, 130)),
        (R({"K35.80": 0.6, "K35.890": 0.25, "K35.209": 0.15}),),
        "A one-off surgical emergency of younger adults.",
        tags=("gi", "surgery"), procedures=(Procedure("0DTJ4ZZ", 0.95),), meds=("cefoxitin",), los_days=1.5,
        plan="surgical clinic in two weeks",
    ),
    Reason(
        "diverticulitis", "Diverticulitis of the colon",
        H(0.0015, per_decade=1.5, risks={"obesity": 1.5}),
        (R({"K57.32": 0.85, "K57.20": 0.15}),),
        "Left-sided diverticulitis of older adults; recurs in some.",
        tags=("gi",), meds=("ciprofloxacin", "metronidazole"), los_days=3.5, plan="colonoscopy after recovery",
    ),
    Reason(
        "bowel_obstruction", "Small-bowel obstruction",
        H(0.0008, per_decade=1.4, risks={"colorectal_cancer": 3.0}),
        (R({"K56.609": 0.6, "K56.52": 0.4}),),
        "Adhesive obstruction, mostly after abdominal surgery.",
        tags=("gi",), procedures=(Procedure("0D9670Z", 0.6),), los_days=5.0, plan="advance diet as tolerated",
    ),
    Reason(
        "gastroenteritis", "Gastroenteritis with dehydration",
        H(0.002, per_decade=1.3, risks={"chemo": 2.0}),
        (R({"A08.4": 0.5, "K52.9": 0.5}),),
        "Infectious or non-infectious gastroenteritis needing intravenous fluids.",
        tags=("gi",), secondary=(extra("E86.0", 0.6),), meds=("ondansetron",), los_days=2.0, plan="oral rehydration",
    ),
    Reason(
        "alcohol_withdrawal", "Alcohol withdrawal",
        H(0.12, requires="alcohol_use"),
        (R({"F10.230": 0.5, "F10.239": 0.3, "F10.231": 0.2}),),
        "Withdrawal (with delirium in some) in alcohol dependence; replaces the dependence code.",
        tags=("psych",), covers=("alcohol_use",), meds=("lorazepam", "thiamine", "folic acid"), los_days=3.5,
        plan="addiction medicine referral",
    ),
    Reason(
        "hepatic_decompensation", "Decompensated cirrhosis",
        H(0.25, requires="cirrhosis"),
        (R({"K70.31": 0.5, "K70.41": 0.2, "K76.82": 0.3}, "alcohol_use"), R({"K76.82": 0.5, "K74.60": 0.5})),
        "Ascites, hepatic encephalopathy or peritonitis in cirrhosis.",
        tags=("gi",), covers=("cirrhosis",),
        secondary=(extra("R18.8", 0.5), extra("K65.2", 0.15), extra("K76.82", 0.25)),
        procedures=(Procedure("0W9G3ZZ", 0.5),), meds=("lactulose", "rifaximin", "spironolactone"), los_days=5.0,
        mortality=0.06, plan="hepatology clinic, paracentesis as needed",
    ),
    Reason(
        "psychiatric_crisis", "Psychiatric decompensation",
        H(0.12, requires="serious_mental_illness"),
        (R({"F20.9": 0.35, "F31.2": 0.35, "F25.0": 0.3}),),
        "Relapse of psychosis or mania requiring admission.",
        tags=("psych",), covers=("serious_mental_illness",), meds=("olanzapine",), los_days=8.0,
        plan="community mental-health team follow-up",
    ),
    Reason(
        "elective_arthroplasty", "Elective knee or hip replacement",
        H(0.06, risks={"obesity": 1.3}, requires="osteoarthritis !joint_replacement", ages=(45, 90)),
        (R({"M17.11": 1.0}, "osteoarthritis:knee_right"), R({"M17.12": 1.0}, "osteoarthritis:knee_left"),
         R({"M16.11": 1.0}, "osteoarthritis:hip_right"), R({"M16.12": 1.0}, "osteoarthritis:hip_left"),
         R({"M17.0": 1.0}, "osteoarthritis:knee_bilateral")),
        "End-stage osteoarthritis replaced on its own side; leaves joint-replacement status.",
        admission="ELECTIVE", tags=("surgery",), covers=("osteoarthritis",), coding_depth=0.8,
        procedures=(Procedure("0SRC0J9", 1.0, "osteoarthritis:knee_right"),
                    Procedure("0SRD0J9", 1.0, "osteoarthritis:knee_left"),
                    Procedure("0SR90J9", 1.0, "osteoarthritis:hip_right"),
                    Procedure("0SRB0J9", 1.0, "osteoarthritis:hip_left"),
                    Procedure("0SRC0J9", 1.0, "osteoarthritis:knee_bilateral")),
        meds=("enoxaparin", "oxycodone"), los_days=2.5, sets={"joint_replacement": "=osteoarthritis"},
        plan="physical therapy, anticoagulation for four weeks",
    ),
    # -- oncology --------------------------------------------------------------------------
    Reason(
        "chemotherapy", "Admission for antineoplastic chemotherapy",
        H(1.2, requires="chemo"),
        (R({"Z51.11": 1.0}),),
        "Cycles of inpatient chemotherapy during the treatment phase.",
        admission="ELECTIVE", tags=("oncology",), procedures=(Procedure("3E04305", 0.9),),
        secondary=(extra("R11.2", 0.2), extra("E86.0", 0.1)),
        meds=("ondansetron", "dexamethasone"), los_days=2.0, coding_depth=0.8, plan="next cycle in three weeks",
    ),
    Reason(
        "febrile_neutropenia", "Febrile neutropenia after chemotherapy",
        H(0.5, requires="chemo"),
        (R({"D70.1": 1.0}),),
        "Drug-induced neutropenia with fever: D70.1 with R50.81 and the adverse-effect code.",
        tags=("oncology", "infection"), secondary=(extra("R50.81", 0.85), extra("T45.1X5A", 0.75)),
        meds=("cefepime", "filgrastim"), los_days=5.0, mortality=0.03, plan="growth-factor support next cycle",
    ),
    Reason(
        "cancer_progression", "Complications of metastatic cancer",
        H(1.2, requires="metastatic"),
        (R({"C78.7": 0.3, "C79.51": 0.3, "C78.00": 0.2, "C79.31": 0.2}),),
        "Pain, effusions and decline of metastatic disease; palliative care is often involved.",
        tags=("oncology",), secondary=(extra("Z51.5", 0.4), extra("G89.3", 0.5), extra("J91.0", 0.15)),
        procedures=(Procedure("0W9930Z", 0.1),), meds=("oxycodone", "dexamethasone"), los_days=6.0, mortality=0.15,
        plan="palliative care follow-up",
    ),
    # -- pregnancy -------------------------------------------------------------------------
    Reason(
        "antepartum_complication", "Antepartum admission",
        H(0.6, requires="pregnancy", risks={"gestational_hypertension": 3.0, "gestational_diabetes": 1.5}),
        (R({"O21.1": 0.6, "O21.0": 0.4}, "pregnancy:t1"),
         R({"O60.02": 0.5, "O47.02": 0.5}, "pregnancy:t2"),
         R({"O60.03": 0.4, "O47.03": 0.4, "O26.893": 0.2})),
        "Hyperemesis in the first trimester, preterm or false labour later; gestational "
        "hypertension and diabetes are coded by the pregnancy states.",
        admission="URGENT", tags=("obstetric",), coding_depth=0.6, meds=("ondansetron",), los_days=2.0,
        plan="obstetric clinic in one week",
    ),
    Reason(
        "miscarriage", "Spontaneous abortion",
        H(0.35, requires="pregnancy:t1"),
        (R({"O03.9": 0.8, "O03.4": 0.2}),),
        "First-trimester pregnancy loss ends the pregnancy.",
        admission="URGENT", tags=("obstetric",), coding_depth=0.5, procedures=(Procedure("10D17ZZ", 0.4),),
        los_days=1.0, clears=("pregnancy",), plan="obstetric follow-up, support",
    ),
    Reason(
        "delivery_vaginal", "Vaginal delivery",
        H(0.68, risks={"prior_cesarean": 0.35, "gestational_hypertension": 0.7}),
        (R({"O80": 0.55, "O70.0": 0.2, "O70.1": 0.15, "O48.0": 0.1}),),
        "Labour at term; uncomplicated deliveries are O80, otherwise the complication is coded; the "
        "outcome of delivery Z37.0 always accompanies it.",
        admission="URGENT", tags=("obstetric",), scheduled="delivery", coding_depth=0.6,
        secondary=(extra("Z37.0", 0.97), extra("O72.1", 0.05), extra("O99.824", 0.2), extra("O99.02", 0.15)),
        procedures=(Procedure("10E0XZZ", 0.95), Procedure("0KQM0ZZ", 0.2)), meds=("oxytocin",), los_days=2.0,
        clears=("pregnancy",), plan="postpartum visit in six weeks",
    ),
    Reason(
        "delivery_cesarean", "Caesarean delivery",
        H(0.32, risks={"prior_cesarean": 3.0, "gestational_hypertension": 2.0, "obesity": 1.5, "age40": 1.5}),
        (R({"O34.211": 1.0}, "prior_cesarean"), R({"O82": 0.4, "O32.1XX0": 0.3, "O64.1XX0": 0.3})),
        "Planned or intrapartum caesarean; a previous caesarean scar makes repeat caesarean likely.",
        admission="URGENT", tags=("obstetric", "surgery"), scheduled="delivery", coding_depth=0.6,
        secondary=(extra("Z37.0", 0.97), extra("O99.824", 0.2), extra("O99.02", 0.2)),
        procedures=(Procedure("10D00Z1", 1.0),), meds=("oxytocin", "cefazolin"), los_days=3.0,
        clears=("pregnancy",), sets={"prior_cesarean": "present"}, plan="wound check, postpartum visit in six weeks",
    ),
) + tuple(r for _, r in _CANCERS)

# ---------------------------------------------------------------------------------------------
# Problems arising or noticed during a stay
# ---------------------------------------------------------------------------------------------
COMPLICATIONS: tuple[Complication, ...] = (
    Complication("aki", "Acute kidney injury", 0.06, (R({"N17.9": 0.85, "N17.0": 0.15}),),
                 "Pre-renal or tubular injury, much likelier with CKD, heart failure and sepsis.",
                 risks={"ckd": 5.0, "heart_failure": 2.5, "reason:sepsis": 6.0, "infection": 1.5, "age80": 1.5,
                        "reason:hf_exacerbation": 1.5}, requires="!dialysis"),
    Complication("hyponatremia", "Hyponatraemia", 0.09, (R({"E87.1": 1.0}),),
                 "Dilutional in heart failure and cirrhosis, drug-induced in the elderly.",
                 risks={"heart_failure": 3.0, "cirrhosis": 6.0, "respiratory": 2.0, "age80": 2.0}),
    Complication("potassium_disorder", "Hypo- or hyperkalaemia", 0.108,
                 (R({"E87.5": 1.0}, "ckd:stage4"), R({"E87.5": 1.0}, "ckd:stage5"), R({"E87.5": 1.0}, "ckd:esrd"),
                  R({"E87.6": 1.0})),
                 "Hyperkalaemia in advanced CKD; hypokalaemia from diuretics and diarrhoea.",
                 risks={"heart_failure": 2.0, "ckd": 2.5, "gi": 2.5, "ckd_advanced": 2.0}),
    Complication("anemia", "Anaemia by mechanism", 0.108,
                 (R({"D63.0": 0.6, "D61.810": 0.4}, "chemo"), R({"D63.0": 1.0}, "active_cancer"),
                  R({"D63.1": 0.8, "D64.9": 0.2}, "ckd_advanced"), R({"D64.9": 1.0})),
                 "Anaemia in neoplastic disease and chemotherapy-induced pancytopenia during cancer "
                 "treatment, anaemia in CKD from stage 3b, otherwise unspecified.",
                 risks={"chemo": 10.0, "active_cancer": 6.0, "ckd_advanced": 8.0, "ckd": 1.5, "age80": 1.3},
                 requires="!iron_deficiency"),
    Complication("thrombocytopenia", "Thrombocytopenia", 0.053, (R({"D69.6": 1.0}),),
                 "Hypersplenism in cirrhosis and marrow suppression in chemotherapy.",
                 risks={"cirrhosis": 12.0, "chemo": 8.0}),
    Complication("delirium", "Delirium", 0.053, (R({"F05": 0.7, "R41.0": 0.3}),),
                 "Acute confusion of the old and cognitively impaired, especially with infection.",
                 risks={"dementia": 5.0, "age80": 2.5, "infection": 2.0, "parkinson": 2.0}),
    Complication("malnutrition", "Protein-calorie malnutrition", 0.053,
                 (R({"E44.0": 0.5, "E43": 0.3, "E46": 0.2}),),
                 "Wasting in cancer, cirrhosis, dementia and COPD.",
                 risks={"active_cancer": 5.0, "cirrhosis": 4.0, "dementia": 3.0, "copd:severe": 3.0, "age80": 1.5}),
    Complication("pressure_ulcer", "Pressure ulcer", 0.022,
                 (R({"L89.152": 0.35, "L89.153": 0.25, "L89.154": 0.15, "L89.159": 0.25}),),
                 "Sacral pressure injuries of immobile patients.",
                 risks={"dementia": 5.0, "hip_fracture_recovery": 4.0, "stroke_history": 2.0, "age80": 2.0}),
    Complication("urinary_retention", "Urinary retention", 0.025, (R({"R33.9": 1.0}),),
                 "Prostatic obstruction, anticholinergic drugs, postoperative state.",
                 risks={"bph": 6.0, "surgery": 2.0}),
    Complication("c_difficile", "Clostridioides difficile colitis", 0.022, (R({"A04.72": 0.8, "A04.71": 0.2}),),
                 "Follows antibiotic exposure in hospitalised patients.",
                 risks={"infection": 4.0, "age80": 1.5}),
    Complication("hypomagnesemia", "Hypomagnesaemia", 0.053, (R({"E83.42": 1.0}),),
                 "Alcohol use, diuretics and proton-pump inhibitors.",
                 risks={"alcohol_use": 5.0, "gerd": 1.5, "heart_failure": 1.5}),
    Complication("dnr", "Do-not-resuscitate status", 0.022, (R({"Z66": 1.0}),),
                 "Goals-of-care decisions in advanced age, dementia and metastatic cancer.",
                 risks={"age80": 5.0, "dementia": 4.0, "metastatic": 8.0, "heart_failure": 1.5}),
    Complication("fall_history", "History of falling", 0.022, (R({"Z91.81": 1.0}),),
                 "Recorded for frail patients with gait disorders.",
                 risks={"age80": 4.0, "dementia": 3.0, "parkinson": 4.0, "hip_fracture_recovery": 4.0}),
    Complication("lactic_acidosis", "Lactic acidosis", 0.011, (R({"E87.21": 0.5, "E87.20": 0.5}),),
                 "Hypoperfusion in sepsis and shock.",
                 risks={"reason:sepsis": 60.0, "cirrhosis": 3.0}),
    Complication("hypoxemia", "Hypoxaemia", 0.053, (R({"R09.02": 1.0}),),
                 "Low oxygen saturation noted without respiratory failure.",
                 risks={"respiratory": 4.0, "heart_failure": 2.0, "copd": 2.0}),
    Complication("metabolic_encephalopathy", "Metabolic or toxic encephalopathy", 0.03,
                 (R({"G93.41": 0.8, "G92.8": 0.2}),),
                 "Acute brain dysfunction from sepsis, uraemia or liver failure.",
                 risks={"reason:sepsis": 6.0, "cirrhosis": 4.0, "ckd_advanced": 2.0, "age80": 2.0, "dementia": 2.0}),
    Complication("hypotension", "Hypotension", 0.063, (R({"I95.9": 0.7, "I95.89": 0.3}),),
                 "Low blood pressure from infection, bleeding or over-treatment.",
                 risks={"infection": 2.5, "reason:gi_bleed": 3.0, "heart_failure": 1.5, "dialysis": 3.0}),
    Complication("leukocytosis", "Leukocytosis", 0.053, (R({"D72.829": 1.0}),),
                 "Raised white count recorded without a final infectious diagnosis.",
                 risks={"respiratory": 2.0, "injury": 2.0}),
    Complication("dysphagia", "Dysphagia", 0.03, (R({"R13.10": 0.6, "R13.12": 0.4}),),
                 "Swallowing difficulty after stroke and in neurodegenerative disease.",
                 risks={"stroke_history": 5.0, "parkinson": 5.0, "dementia": 3.0}),
    Complication("constipation", "Constipation", 0.063, (R({"K59.00": 0.7, "K59.09": 0.3}),),
                 "Immobility, opioids and Parkinson's disease.",
                 risks={"surgery": 3.0, "injury": 3.0, "parkinson": 4.0, "metastatic": 4.0}),
    Complication("vitamin_d_deficiency", "Vitamin D deficiency", 0.063, (R({"E55.9": 1.0}),),
                 "Found on admission bloods in the elderly, CKD and malnutrition.",
                 risks={"ckd": 2.0, "age80": 1.5, "osteoporosis": 2.0}),
    Complication("insomnia", "Insomnia", 0.041, (R({"G47.00": 0.8, "F51.01": 0.2}),),
                 "Sleep disturbance noted during the stay.",
                 risks={"depression": 2.5, "anxiety": 2.5}),
    Complication("hyperglycemia", "Hyperglycaemia without diabetes", 0.063, (R({"R73.9": 0.7, "R73.09": 0.3}),),
                 "Stress or steroid-induced hyperglycaemia in people without diabetes.",
                 risks={"infection": 2.0, "reason:copd_exacerbation": 3.0}, requires="!diabetes"),
    Complication("tachycardia", "Tachycardia", 0.041, (R({"R00.0": 1.0}),),
                 "Sinus tachycardia with fever, bleeding or dehydration.",
                 risks={"infection": 2.0, "gi": 2.0}, requires="!atrial_fibrillation"),
    Complication("pleural_effusion", "Pleural effusion", 0.03, (R({"J90": 0.6, "J91.8": 0.4}),),
                 "Effusions of heart failure, pneumonia and malignancy.",
                 risks={"heart_failure": 3.0, "reason:pneumonia": 3.0, "active_cancer": 3.0}),
)

# Derived facts the simulator computes; listed so the docs can explain every token used above.
FACTS = {
    "female / male": "sex",
    "age40 / age65 / age80": "age at the time is at least 40 / 65 / 80",
    "diabetes": "type 1 or type 2 diabetes",
    "hba1c_high": "the latent HbA1c of a diabetic exceeds 9%",
    "ckd_advanced": "CKD stage 3b or worse",
    "anticoag_indication": "atrial fibrillation or a history of venous thromboembolism",
    "chemo": "a cancer in its treatment (chemotherapy) phase",
    "active_cancer": "a cancer that is new, in treatment or metastatic",
    "metastatic": "a metastatic cancer",
    "dementia_alzheimer": "the dementia's sticky subtype is Alzheimer's disease",
    "aspiration_risk": "dementia or Parkinson's disease (aspiration pneumonia)",
    "covid_era": "the time is after March 2020",
    "pregnancy:t1 / t2 / t3": "trimester from the gestational age at the time",
    "reason:<name>, obstetric, infection, ...": "inside an encounter: its reason and the reason's tags",
}

CHRONIC_BY_NAME = {c.name: c for c in CHRONIC}
REASON_BY_NAME = {r.name: r for r in REASONS}
WEEK_CODES = tuple(f"Z3A.{w:02d}" for w in range(8, 43))


def _rules_of_definition(d) -> list[Rule]:
    rules = list(getattr(d, "codes", ()) or ()) + list(getattr(d, "principal", ()) or ())
    for e in getattr(d, "also", ()) + getattr(d, "secondary", ()):
        rules.extend(e.rules)
    return rules


def codes_of(definition) -> list[str]:
    """Every ICD-10-CM code (dotted) a definition can emit, in definition order."""
    out: list[str] = []
    for rule in _rules_of_definition(definition):
        for code in rule.codes:
            for c in (WEEK_CODES if code == "Z3A.{week}" else (code,)):
                if c not in out:
                    out.append(c)
    return out


def validate_definitions(chronic: tuple[Chronic, ...] = CHRONIC, reasons: tuple[Reason, ...] = REASONS,
                         complications: tuple[Complication, ...] = COMPLICATIONS) -> dict[str, str]:
    """Check every code is a billable ICD-10-CM code and references resolve; return code → owner.

    Each code belongs to one condition (the owner), which is how target codes are attributed
    to conditions in the realism report.
    """
    by_name = {c.name: c for c in chronic}
    names = [d.name for d in (*chronic, *reasons, *complications)]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ConfigError(f"synthetic conditions: duplicate names {sorted(duplicates)}: rename one of each")
    owner: dict[str, str] = {}
    for d in (*chronic, *reasons, *complications):
        for code in codes_of(d):
            if not icd.is_valid_item(code):
                raise ConfigError(f"synthetic condition '{d.name}': {code} is not an ICD-10-CM code: "
                                  "fix the definition")
            if not icd.is_leaf(code):
                raise ConfigError(f"synthetic condition '{d.name}': {code} is not billable (it has children "
                                  f"{icd.get_children(code)[:4]}…): use a billable leaf")
            owner.setdefault(code, d.name)
    for r in reasons:
        for target in list(r.sets) + list(r.clears) + list(r.covers):
            if target not in by_name:
                raise ConfigError(f"synthetic reason '{r.name}': unknown state '{target}' in sets/clears/covers")
        for target, stage in r.sets.items():
            if not stage.startswith("=") and stage not in by_name[target].stages:
                raise ConfigError(f"synthetic reason '{r.name}': '{target}' has no stage '{stage}'; "
                                  f"stages: {by_name[target].stages}")
    for c in chronic:
        if c.initial is not None and len(c.initial) != len(c.stages):
            raise ConfigError(f"synthetic condition '{c.name}': {len(c.initial)} initial weights for "
                              f"{len(c.stages)} stages")
    return owner


CODE_OWNER: dict[str, str] = validate_definitions()

# Titles of the ICD-10-PCS procedure codes used above (the PCS tables are not packaged offline).
PCS_TITLES = {
    "02100Z9": "Bypass one coronary artery from left internal mammary, open approach",
    "021109W": "Bypass two coronary arteries from aorta with autologous venous tissue, open approach",
    "027034Z": "Dilation of one coronary artery with drug-eluting intraluminal device, percutaneous",
    "02H63JZ": "Insertion of pacemaker lead into right atrium, percutaneous",
    "02HK3JZ": "Insertion of pacemaker lead into right ventricle, percutaneous",
    "02HV33Z": "Insertion of infusion device into superior vena cava, percutaneous (central line)",
    "03CG3ZZ": "Extirpation of matter from intracranial artery, percutaneous (thrombectomy)",
    "0BTC4ZZ": "Resection of right upper lung lobe, percutaneous endoscopic",
    "0BTG4ZZ": "Resection of left upper lung lobe, percutaneous endoscopic",
    "0D9670Z": "Drainage of stomach with drainage device, via natural opening (nasogastric decompression)",
    "0DJ08ZZ": "Inspection of upper intestinal tract, via natural opening endoscopic (EGD)",
    "0DJD8ZZ": "Inspection of lower intestinal tract, via natural opening endoscopic (colonoscopy)",
    "0DTJ4ZZ": "Resection of appendix, percutaneous endoscopic",
    "0DTN0ZZ": "Resection of sigmoid colon, open approach",
    "0DTP0ZZ": "Resection of rectum, open approach",
    "0FT44ZZ": "Resection of gallbladder, percutaneous endoscopic",
    "0HBT0ZZ": "Excision of right breast, open approach (lumpectomy)",
    "0HTT0ZZ": "Resection of right breast, open approach (mastectomy)",
    "0HTU0ZZ": "Resection of left breast, open approach (mastectomy)",
    "0JH606Z": "Insertion of dual-chamber pacemaker into chest subcutaneous tissue, open approach",
    "0KQM0ZZ": "Repair of perineum muscle, open approach (obstetric laceration)",
    "0QS634Z": "Reposition of right upper femur with internal fixation device, percutaneous",
    "0QS734Z": "Reposition of left upper femur with internal fixation device, percutaneous",
    "0SR90J9": "Replacement of right hip joint with synthetic substitute, cemented, open approach",
    "0SRB0J9": "Replacement of left hip joint with synthetic substitute, cemented, open approach",
    "0SRC0J9": "Replacement of right knee joint with synthetic substitute, cemented, open approach",
    "0SRD0J9": "Replacement of left knee joint with synthetic substitute, cemented, open approach",
    "0VT04ZZ": "Resection of prostate, percutaneous endoscopic",
    "0W9930Z": "Drainage of right pleural cavity with drainage device, percutaneous",
    "0W9G3ZZ": "Drainage of peritoneal cavity, percutaneous (paracentesis)",
    "0Y6N0Z0": "Detachment at right foot, complete, open approach (amputation)",
    "10D00Z1": "Extraction of products of conception, low cervical, open approach (caesarean)",
    "10D17ZZ": "Extraction of retained products of conception, via natural opening (D&C)",
    "10E0XZZ": "Delivery of products of conception, external approach (vaginal delivery)",
    "30233N1": "Transfusion of nonautologous red blood cells into peripheral vein, percutaneous",
    "3E03317": "Introduction of other thrombolytic into peripheral vein, percutaneous (alteplase)",
    "3E04305": "Introduction of other antineoplastic into central vein, percutaneous (chemotherapy)",
    "4A023N7": "Measurement of cardiac sampling and pressure, left heart, percutaneous (catheterization)",
    "5A09357": "Assistance with respiratory ventilation, less than 24 hours, CPAP/non-invasive",
    "5A1221Z": "Performance of cardiac output, continuous (cardiopulmonary bypass)",
    "5A1935Z": "Respiratory ventilation, less than 24 consecutive hours",
    "5A1D70Z": "Performance of urinary filtration, intermittent, less than 6 hours per day (haemodialysis)",
    "5A2204Z": "Restoration of cardiac rhythm, single (cardioversion)",
    "B020ZZZ": "Computerized tomography of brain",
    "B2111ZZ": "Fluoroscopy of multiple coronary arteries using low osmolar contrast (angiography)",
}


def _check_procedures() -> None:
    for r in REASONS:
        for p in r.procedures:
            if p.code not in PCS_TITLES:
                raise ConfigError(f"synthetic reason '{r.name}': procedure {p.code} has no title in PCS_TITLES")


_check_procedures()
